"""Decoding nvCOMP blobs on the GPU: many tensors per batched call, byte planes joined on the device.

:func:`decode_many` is what a GPU restore uses; :class:`NvcompDecoder` adapts it to the
one-tensor :class:`~asyncckpt._codecs.Decoder` interface so :func:`asyncckpt._loader.verify` and
host-side loads of GPU-only codecs work on a GPU machine (blobs are moved to the GPU and back).
The codec registry (:mod:`asyncckpt._codecs`) imports this module on the first GPU-only codec it meets.

Runs on the calling thread; GPU work goes on a per-thread decode stream, and every function
returns only once its outputs are complete.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from . import batch as batch
from .planes import join_into, join_tensor_into, plane_stride
from .specs import CodecSpec, spec_from_manifest
from .staging import aligned_offsets

_local = threading.local()


def decode_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's decode stream on ``device``."""
    streams: dict[int, torch.cuda.Stream] = getattr(_local, "streams", None) or {}
    _local.streams = streams
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in streams:
        streams[index] = torch.cuda.Stream(device=index)
    return streams[index]


@dataclass
class DecodeItem:
    """One tensor to decode: its blob and output on the same CUDA device."""

    blob: torch.Tensor
    chunks: Sequence[tuple[int, int]]
    out: torch.Tensor
    where: str


def _regular_chunk(chunks: Sequence[tuple[int, int]], planes: int, where: str) -> int | None:
    """The chunk size when every chunk but the last has it (None when they differ)."""
    raws = [r for _s, r in chunks]
    if any(r % planes for r in raws):
        raise CorruptCheckpointError(f"{where}: a chunk is not a whole number of {planes}-byte items")
    if len(raws) > 1 and (any(r != raws[0] for r in raws[:-1]) or raws[-1] > raws[0]):
        return None
    return raws[0] if raws else planes


def decode_many(spec: CodecSpec, items: Sequence[DecodeItem]) -> None:
    """Decode every item (one nvCOMP batch for all their chunks); blocks until the outputs are complete.

    Raises CorruptCheckpointError naming the item when a chunk does not decode to its recorded size.
    """
    items = [item for item in items if item.out.numel()]
    if not items:
        return
    device = items[0].out.device
    stream = decode_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # blobs/outputs made on the caller's stream
    with torch.cuda.device(device), torch.cuda.stream(stream):
        alignment = batch.required_decode_alignment(spec, stream)
        src_offsets, stored, raw = [], [], []
        sources = []
        for item in items:
            if sum(s for s, _r in item.chunks) != item.blob.numel():
                raise CorruptCheckpointError(f"{item.where}: chunk sizes do not add up to the blob's size")
            position = item.blob.data_ptr()
            for s, r in item.chunks:
                sources.append((position, s))
                stored.append(s)
                raw.append(r)
                position += s
        keep: list[torch.Tensor] = []
        if any(p % alignment for p, _s in sources):
            # Packed chunks start anywhere; this codec wants aligned inputs: copy them apart.
            offsets, end = [], 0
            for _p, s in sources:
                offsets.append(end)
                end += (s + 15) // 16 * 16
            aligned = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
            keep.append(aligned)
            targets, pieces = [], []
            for item in items:
                flat = item.blob
                at = 0
                for s, _r in item.chunks:
                    pieces.append(flat[at : at + s])
                    at += s
            for offset, piece in zip(offsets, pieces, strict=True):
                targets.append(aligned[offset : offset + piece.numel()])
            torch._foreach_copy_(targets, pieces)
            src_span: batch.DeviceSpan = batch.DeviceSpan(aligned.data_ptr(), aligned.numel())
            src_offsets = offsets
        else:
            src_span, base = batch.span_of([item.blob for item in items])
            src_offsets = [p - base for p, _s in sources]
        typestr = batch.typestr_for(spec)
        if spec.planes == 1:
            dst_span, base = batch.span_of([item.out for item in items], typestr)
            dst_offsets, planar = [], None
            for item in items:
                at = item.out.data_ptr() - base
                for _s, r in item.chunks:
                    dst_offsets.append(at)
                    at += r
        elif spec.planes_span == "tensor":
            sizes = [spec.planes * plane_stride(item.out.numel(), spec.planes) for item in items]
            starts, total = aligned_offsets(sizes)
            planar = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
            dst_span = batch.DeviceSpan(planar.data_ptr(), total, typestr)
            dst_offsets = []
            for item, start in zip(items, starts, strict=True):
                dst_offsets += [start + offset for offset in _wide_chunk_offsets(item, spec.planes)]
        else:
            total = sum(item.out.numel() for item in items)
            planar = torch.empty(total, dtype=torch.uint8, device=device)
            dst_span = batch.DeviceSpan(planar.data_ptr(), total, typestr)
            dst_offsets = []
            at = 0
            for item in items:
                for _s, r in item.chunks:
                    dst_offsets.append(at)
                    at += r
        try:
            batch.decode(spec, src_span, src_offsets, stored, dst_span, dst_offsets, raw, stream)
        except CorruptCheckpointError as exc:
            names = ", ".join(item.where for item in items[:3])
            raise CorruptCheckpointError(f"{names}{' ...' if len(items) > 3 else ''}: {exc}") from exc
        if planar is not None and spec.planes_span == "tensor":
            for item, start, size in zip(items, starts, sizes, strict=True):
                join_tensor_into(planar[start : start + size], item.out, spec.planes)
        elif planar is not None:
            at = 0
            for item in items:
                n = item.out.numel()
                _join(planar[at : at + n], item, spec.planes)
                at += n
        stream.synchronize()
        del keep


def _wide_chunk_offsets(item: DecodeItem, planes: int) -> list[int]:
    """Where each chunk of a tensor-wide split goes in its planar rows; every chunk must lie
    inside one plane and the planes must be filled exactly (hostile input otherwise)."""
    nbytes = item.out.numel()
    if nbytes % planes:
        raise CorruptCheckpointError(f"{item.where}: {nbytes} bytes are not whole {planes}-byte items")
    items, stride = nbytes // planes, plane_stride(nbytes, planes)
    offsets, plane, at = [], 0, 0
    for _s, r in item.chunks:
        if plane >= planes or at + r > items:
            raise CorruptCheckpointError(f"{item.where}: a chunk crosses a plane boundary")
        offsets.append(plane * stride + at)
        at += r
        if at == items:
            plane, at = plane + 1, 0
    if plane != planes and items:
        raise CorruptCheckpointError(f"{item.where}: chunks do not fill the {planes} planes")
    return offsets


def _join(planar: torch.Tensor, item: DecodeItem, planes: int) -> None:
    chunk = _regular_chunk(item.chunks, planes, item.where)
    if chunk is not None:
        join_into(planar, item.out, chunk, planes)
        return
    at = 0
    for _s, r in item.chunks:  # irregular chunking (another writer's): one chunk at a time
        join_into(planar[at : at + r], item.out[at : at + r], r, planes)
        at += r


class NvcompDecoder:
    """The :class:`~asyncckpt._codecs.Decoder` of one nvCOMP codec name, for host or device buffers."""

    def __init__(self, codec: str) -> None:
        self.codec = codec

    def decode(
        self, blob: torch.Tensor, chunks: list[tuple[int, int]], params: Mapping[str, Any], out: torch.Tensor
    ) -> None:
        spec = spec_from_manifest(self.codec, params, "nvCOMP blob")
        device = out.device if out.is_cuda else (blob.device if blob.is_cuda else torch.device("cuda"))
        target = out if out.is_cuda else torch.empty(out.numel(), dtype=torch.uint8, device=device)
        decode_many(spec, [DecodeItem(blob.to(device), chunks, target, "blob")])
        if target is not out:
            out.copy_(target)
