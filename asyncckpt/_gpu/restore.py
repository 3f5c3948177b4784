"""Restore to the GPU: reads into device memory, CRC-32 verified on the device, nvCOMP decodes.

Tensors land on their CUDA device without a round trip through host memory: KvikIO reads
straight into device memory under GDS; in compat mode (no GDS) large sequential reads go
through two pinned buffers (:func:`asyncckpt._gpu.storage.open_device_reader` says why). The data file is
read in windows of consecutive blobs (about ``window_bytes`` each), the next window's read
running while the current one is verified and decoded, so a restore runs at the speed of the
storage. Records of one codec spec in a window decode in one batched nvCOMP call.

Everything read is hostile input until checked: blobs must lie inside their file (checked
before any read), checksums are verified before decoding, and every chunk must decode to
exactly its recorded size. ``crc32`` blobs are verified on the device (nvCOMP); only ``mix64``
blobs (what the GPU path wrote until 2026-12-05) cross to host memory to be verified there.

Delta checkpoints (format 4) restore through :func:`decode_chain_on_device`: this checkpoint's
records and the base's counterparts of its delta records (recursively, as far as the chain
goes), then each delta undone in place on the device (:func:`~asyncckpt._delta_ops.decode_delta`).
The levels of a chain are read and decoded concurrently, one thread each, while the GPU has room
for all of them (a restore is bound by reading, and one file's reads leave the storage idle
between windows); otherwise one after another, holding about twice the restored bytes at most.

Runs on the calling thread (plus KvikIO's pool and a decode stream).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .. import _checksum as checksum
from .._delta_chain import ChainReader
from .._delta_ops import decode_delta
from .._dtypes import dtype_from_name
from .._manifest import Manifest, TensorRecord
from .._read_layout import check_layout, destination, tensor_where
from ..errors import CheckpointError, CorruptCheckpointError
from .checksum import crc32_device
from .decoders import DecodeItem, decode_many
from .specs import ALGORITHMS, CodecSpec, spec_from_manifest
from .storage import DeviceBlobReader, configure_threads, open_device_reader

DEFAULT_WINDOW_BYTES = 1 << 30
CONCURRENT_LEVELS_HEADROOM = 4
"""A chain's levels are decoded concurrently when the free GPU memory exceeds this many times a
level's raw bytes (a chain of ``delta_full_every`` = 4 levels, the default, with a level to spare)."""


def decode_chain_on_device(checkpoint: Path, manifest: Manifest, target: torch.device | None,
                           depth: int = 0) -> list[torch.Tensor]:  # fmt: skip
    """Every tensor of ``manifest``, in table order, on its destination device, its deltas undone."""
    deltas = [i for i, record in enumerate(manifest.tensors) if record.delta is not None]
    if not deltas:
        return decode_on_device(checkpoint, manifest, target)
    records = manifest.tensors
    with ChainReader(checkpoint, manifest, depth) as chain, ThreadPoolExecutor(1, "asyncckpt-restore") as pool:
        try:
            base = chain.base()
            needed = dataclasses.replace(base.manifest, tensors=[chain.base_record(records[i]) for i in deltas])
        except CorruptCheckpointError as exc:
            raise chain.base_error(records[deltas[0]], exc) from exc
        own = pool.submit(decode_on_device, checkpoint, manifest, target) if _room_for_levels(manifest) else None
        try:
            bases = decode_chain_on_device(base.checkpoint, needed, target, depth + 1)
        except CorruptCheckpointError as exc:
            raise chain.base_error(records[deltas[0]], exc) from exc
        out = own.result() if own is not None else decode_on_device(checkpoint, manifest, target)
    for i, reference in zip(deltas, bases, strict=True):
        record, tensor = records[i], out[i]
        where = tensor_where(checkpoint, record)
        dtype = dtype_from_name(record.dtype, where)
        stored = tensor.reshape(-1).view(torch.uint8)
        restored = decode_delta(stored, reference.reshape(-1).view(torch.uint8).to(stored.device), str(record.delta),
                                dtype)  # fmt: skip
        out[i] = restored.view(dtype).view(record.shape)
    return out


def _room_for_levels(manifest: Manifest) -> bool:
    """Whether the GPU has room to decode this level while its bases decode (see the module docstring).

    Room is the driver's free memory plus what this process's caching allocator holds in unused
    segments: a restore right after training, or after another restore, finds most memory in
    torch's cache, which ``mem_get_info`` counts as taken although the allocator hands it out (or
    releases it to the driver) before it fails an allocation."""
    device = torch.device("cuda", torch.cuda.current_device())
    # Less the unused pieces of partly used segments, which no allocation of a level's size can take.
    fragments = torch.cuda.memory_stats(device).get("inactive_split_bytes.all.current", 0)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) - fragments
    return torch.cuda.mem_get_info(device)[0] + cached > CONCURRENT_LEVELS_HEADROOM * manifest.raw_bytes


def decode_on_device(
    checkpoint: Path,
    manifest: Manifest,
    target: torch.device | None,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    io_threads: int = 0,
) -> list[torch.Tensor]:
    """Every tensor of ``manifest``, in table order, on its destination device."""
    configure_threads(io_threads)
    records = manifest.tensors
    wheres = [tensor_where(checkpoint, r) for r in records]
    places = [destination(r, target, w) for r, w in zip(records, wheres, strict=True)]
    read_device = next((d for d in places if d.type == "cuda"), torch.device("cuda", torch.cuda.current_device()))
    out: list[torch.Tensor | None] = [None] * len(records)
    by_file: dict[str, list[int]] = {}
    for i, record in enumerate(records):
        by_file.setdefault(record.file, []).append(i)
    files = check_layout(checkpoint, records)  # every blob inside its file, none overlapping, sizes bounded
    for name, indices in by_file.items():
        path = files[name][0]
        empty = [i for i in indices if records[i].stored_bytes == 0]
        for i in empty:  # nothing to read: an empty blob may lie at the aligned end, past the file's last byte
            out[i] = _empty_tensor(records[i], wheres[i], read_device)
        reader = open_device_reader(path, read_device)
        try:
            windows = _windows(records, [i for i in indices if records[i].stored_bytes], window_bytes)
            pending = _start(reader, records, windows[0]) if windows else None
            for k in range(len(windows)):
                current = pending
                pending = _start(reader, records, windows[k + 1]) if k + 1 < len(windows) else None
                assert current is not None
                buffer, future, base, span = current
                reader.finish(future, base, span)
                _decode_window(buffer, base, [(i, records[i], wheres[i]) for i in windows[k]], out, read_device)
        finally:
            reader.close()
    placed = []
    for i, tensor in enumerate(out):
        assert tensor is not None
        placed.append(tensor if tensor.device == places[i] else tensor.to(places[i]))
    return placed


def _windows(records: Sequence[TensorRecord], indices: list[int], window_bytes: int) -> list[list[int]]:
    ordered = sorted(indices, key=lambda i: records[i].offset)
    windows: list[list[int]] = []
    start = None
    for i in ordered:
        r = records[i]
        if start is None or r.offset + r.stored_bytes - start > window_bytes:
            windows.append([])
            start = r.offset
        windows[-1].append(i)
    return windows


def _start(
    reader: DeviceBlobReader, records: Sequence[TensorRecord], window: list[int]
) -> tuple[torch.Tensor, object, int, int]:
    base = records[window[0]].offset
    span = max(records[i].offset + records[i].stored_bytes for i in window) - base
    buffer, future = reader.read_async(base, span)
    return buffer, future, base, span


def _decode_window(
    buffer: torch.Tensor,
    base: int,
    items: list[tuple[int, TensorRecord, str]],
    out: list[torch.Tensor | None],
    device: torch.device,
) -> None:
    by_spec: dict[CodecSpec, list[DecodeItem]] = {}
    for i, record, where in items:
        dtype = dtype_from_name(record.dtype, where)
        blob = buffer[record.offset - base : record.offset - base + record.stored_bytes]
        _verify(blob, record, where)
        try:
            raw = torch.empty(record.raw_bytes, dtype=torch.uint8, device=device)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError included
            raise CheckpointError(f"{where}: cannot allocate {record.raw_bytes} bytes on {device}: {exc}") from exc
        out[i] = (
            raw.view(dtype).view(record.shape)
            if record.raw_bytes
            else torch.empty(record.shape, dtype=dtype, device=device)
        )
        if record.codec == "none":
            if record.stored_bytes != record.raw_bytes:
                raise CorruptCheckpointError(
                    f"{where}: stored {record.stored_bytes} bytes for a raw size of {record.raw_bytes}"
                )
            raw.copy_(blob)
            continue
        if record.codec not in ALGORITHMS:
            raise CorruptCheckpointError(f"{where}: unknown codec {record.codec!r}")
        spec = spec_from_manifest(record.codec, record.codec_params, where)
        by_spec.setdefault(spec, []).append(DecodeItem(blob, record.chunks, raw, where))
    for spec, decode_items in by_spec.items():
        decode_many(spec, decode_items)
    torch.cuda.current_stream(device).synchronize()  # the `none` copies above ran on the caller's stream


def _empty_tensor(record: TensorRecord, where: str, device: torch.device) -> torch.Tensor:
    """The tensor of a record with no stored bytes, which must be empty and checksummed as empty."""
    if record.raw_bytes:
        raise CorruptCheckpointError(f"{where}: stored 0 bytes for a raw size of {record.raw_bytes}")
    _verify(torch.empty(0, dtype=torch.uint8), record, where)
    return torch.empty(record.shape, dtype=dtype_from_name(record.dtype, where), device=device)


def _verify(blob: torch.Tensor, record: TensorRecord, where: str) -> None:
    algorithm = checksum.check_algorithm(record.checksum.algorithm, where)
    actual = crc32_device(blob) if algorithm == "crc32" and blob.is_cuda else checksum.compute(algorithm, blob.cpu())
    checksum.verify_value(algorithm, record.checksum.value, actual, where)
