"""Byte-plane split and join on the GPU, chunk by chunk, in the CPU codec's layout.

Within each chunk of ``n * planes`` bytes, element bytes ``[a0 a1 a2 a3][b0 b1 b2 b3]...``
become ``a0 b0 ... | a1 b1 ... | ...`` — exactly :func:`asyncckpt.codecs.planes.split` applied
to that chunk, so a chunk split here and compressed with zstd, lz4 or deflate decodes on a
CPU. All full-size chunks of a tensor move in one strided copy kernel, the tail chunk in one
more. Kernels run on the current stream of the calling thread.
"""

from __future__ import annotations

import torch


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
