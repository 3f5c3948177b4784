"""Byte-plane split and join on the GPU, chunk by chunk, in the CPU codec's layout.

Within each chunk of ``n * planes`` bytes, element bytes ``[a0 a1 a2 a3][b0 b1 b2 b3]...``
become ``a0 b0 ... | a1 b1 ... | ...`` — exactly :func:`asyncckpt._codecs.planes.split` applied
to that chunk, so a chunk split here and compressed with zstd, lz4 or deflate decodes on a
CPU. All full-size chunks of a tensor move in one strided copy kernel, the tail chunk in one
more. Kernels run on the current stream of the calling thread.

The tensor-wide split (``planes_span="tensor"``, GPU-only) splits a whole tensor once, each
plane in its own 16-byte aligned row, and cuts each plane into chunks of its own.
"""

from __future__ import annotations

import torch

from .kernels import move_planes


def split_into(src: torch.Tensor, dst: torch.Tensor, chunk_bytes: int, planes: int) -> None:
    """Write the per-chunk planes of ``src`` (1-D uint8) into ``dst`` (1-D uint8, same length)."""
    _move(src, dst, chunk_bytes, planes, splitting=True)


def join_into(src: torch.Tensor, dst: torch.Tensor, chunk_bytes: int, planes: int) -> None:
    """Inverse of :func:`split_into`."""
    _move(src, dst, chunk_bytes, planes, splitting=False)


def _move(src: torch.Tensor, dst: torch.Tensor, chunk_bytes: int, planes: int, splitting: bool) -> None:
    nbytes = src.numel()
    if dst.numel() != nbytes or chunk_bytes % planes or nbytes % planes:
        raise ValueError(
            f"cannot move {nbytes} bytes into {dst.numel()} as {planes} planes of {chunk_bytes}-byte chunks"
        )
    if planes == 1:
        dst.copy_(src)
        return
    full, rest = divmod(nbytes, chunk_bytes)
    for start, count, size in ((0, full, chunk_bytes), (full * chunk_bytes, 1 if rest else 0, rest)):
        if not count:
            continue
        a = src[start : start + count * size]
        b = dst[start : start + count * size]
        items = size // planes
        if splitting:  # (count, items, planes) -> (count, planes, items)
            b.view(count, planes, items).copy_(a.view(count, items, planes).transpose(1, 2))
        else:
            b.view(count, items, planes).copy_(a.view(count, planes, items).transpose(1, 2))


# ------------------------------------------------------------------ planes spanning a whole tensor
def plane_stride(nbytes: int, planes: int) -> int:
    """Bytes from one plane's start to the next in a tensor-wide split (16-byte aligned starts)."""
    return (nbytes // planes + 15) // 16 * 16


def plane_chunks(nbytes: int, planes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset in the split buffer, raw size) of every chunk of a tensor-wide split: each plane
    is cut into chunks of its own, so no chunk mixes two planes (each gets its own ANS table)."""
    items, stride = nbytes // planes, plane_stride(nbytes, planes)
    full, rest = divmod(items, chunk_bytes)
    sizes = [chunk_bytes] * full + ([rest] if rest else [])
    return [(p * stride + k * chunk_bytes, n) for p in range(planes) for k, n in enumerate(sizes)]


def split_tensor_into(src: torch.Tensor, dst: torch.Tensor, planes: int) -> None:
    """Byte ``j`` of every element of ``src`` (1-D uint8) into plane ``j`` of ``dst`` (``planes``
    rows of :func:`plane_stride` bytes; the padding is left as it is). One kernel on a GPU
    (:func:`asyncckpt._gpu.kernels.move_planes`), a strided copy on the CPU."""
    items, stride = src.numel() // planes, plane_stride(src.numel(), planes)
    if src.is_cuda:
        move_planes(src, dst, items, planes, stride, splitting=True)
        return
    dst.view(planes, stride)[:, :items].copy_(src.view(items, planes).t())


def join_tensor_into(src: torch.Tensor, dst: torch.Tensor, planes: int) -> None:
    """Inverse of :func:`split_tensor_into`."""
    items, stride = dst.numel() // planes, plane_stride(dst.numel(), planes)
    if dst.is_cuda:
        move_planes(src, dst, items, planes, stride, splitting=False)
        return
    dst.view(items, planes).copy_(src.view(planes, stride)[:, :items].t())
