"""The GPU compression pipeline: nvCOMP on its own CUDA stream and thread, in batches.

``save()`` hands every :class:`~asyncckpt.gpu.snapshot.GpuSnapshot` to the **compressor
thread** (``asyncckpt-compress``) at once. It cuts the state into groups of about
``group_bytes`` of consecutive tensors and, per group:

1. *enqueue* (no host wait): the stream waits on the snapshot's ``ready`` event; host-staged
   tensors are uploaded; per codec spec, one byte-plane split kernel per tensor if the spec
   asks for planes, then **one** nvCOMP batched encode over every chunk of every tensor of the
   group (tensors over the chunk size are cut into chunks);
2. *resolve*: read the compressed sizes (the host waits here), keep per tensor the smallest
   candidate (``codec="auto"`` probes), pack the kept chunks back to back with one
   ``_foreach_copy_``, and hand the group to the worker through the snapshot's
   :class:`~asyncckpt.gpu.snapshot.BlobChannel`.

In ``fence`` mode every group is enqueued first, then an event is recorded and the fence gate
opened — the next optimizer step waits on that event on the GPU — and only then are groups
resolved. Other modes resolve group by group, bounded by the channel's window.

The worker thread (:func:`asyncckpt.persist.write_part`) takes the blobs in tensor order from
:meth:`GpuEncoder.encode_snapshot`, checksums and writes them while the next group compresses.
Tensors under :data:`MIN_COMPRESS_BYTES` are stored raw: nvCOMP's per-chunk overhead would
outweigh what they save.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..codecs import EncodedBlob
from ..snapshot import Snapshot, StagedTensor
from . import batch, kernels
from .auto import DEFAULT_REPROBE_EVERY, CodecChooser
from .planes import plane_stride, split_into, split_tensor_into
from .snapshot import GpuSnapshot, Group
from .specs import CodecSpec
from .staging import TINY_BYTES, aligned_layout, aligned_offsets, copy_fence_stragglers

log = logging.getLogger("asyncckpt")

MIN_COMPRESS_BYTES = TINY_BYTES
DEFAULT_CHUNK_BYTES = 1 << 20
"""Raw bytes per nvCOMP chunk (RAW mode encodes each chunk as one frame)."""
DEFAULT_GROUP_BYTES = 1 << 30
"""Raw bytes of consecutive tensors compressed per nvCOMP call (a larger tensor is a group of its own).

Measured on the H200 (13.6 GB, ANS ``<f4``, nothing else running): 256 MiB groups took 15 ms of
host time to queue and ran at 600-730 GB/s; 1 GiB groups 8 ms and ~900 GB/s; 4 GiB 6 ms and
~1,000 GB/s. Host time matters in ``fence`` mode (the next step waits until everything is
queued) and GPU time while training runs. Outside ``fence`` mode a group's transient GPU memory
is about its size for nvCOMP's outputs, once more for byte planes, and once per extra candidate
on an ``auto`` probe (up to ~4 GiB at 1 GiB); in ``fence`` mode every group's is held until the
gate opens."""
FENCE_GROUP_BYTES = 4 << 30
"""Group size in ``fence`` mode, where the next optimizer step waits until every group is queued.

Every encode call costs ~0.6 ms of host time (the C-API call, its tables, events, allocations;
``python3 -m benchmarks.enqueue_profile`` on the H200: 52 calls over 20 one-GiB groups of a
16 GB state took ~30 ms), so fence mode queues fewer, larger groups. It costs little memory:
in fence mode every group's outputs are held until the gate opens anyway; only the packed
copy of one group (up to this size) is added at the peak."""
PACK_ALIGN_BYTES = 16
"""Start of every blob in a group's packed buffer."""
DEFAULT_WINDOW_BYTES = 1 << 30
"""Compressed bytes that may wait for the writer before the compressor pauses (not in fence mode)."""

_STOP = object()


@dataclass
class CompressStats:
    """What the compressor did for one snapshot (sizes in bytes, times in seconds)."""

    mode: str
    tensors: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    encoded_bytes: int = 0
    """Bytes nvCOMP read: on a probe every candidate reads the tensor once."""
    gpu_seconds: float = 0.0
    """Time of the encode kernels on the GPU (CUDA events around each batched encode)."""
    wall_seconds: float = 0.0
    """Compressor thread time from taking the snapshot to handing over its last group."""
    gate_seconds: float = 0.0
    """Fence mode: compressor thread time until the gate opened (every read queued)."""
    probed: int = 0
    specs: Counter[str] = field(default_factory=Counter)

    @property
    def encode_bytes_per_second(self) -> float:
        return self.encoded_bytes / self.gpu_seconds if self.gpu_seconds else 0.0


@dataclass
class _Option:
    stored: int
    spec: CodecSpec
    pending: batch.PendingEncode
    first: int
    end: int


@dataclass
class _Work:
    """One group between enqueue and resolve."""

    items: list[tuple[int, StagedTensor]]
    raw: list[tuple[int, StagedTensor]]
    pendings: list[tuple[list[int], list[tuple[int, int]], batch.PendingEncode]]
    keep_alive: list[torch.Tensor]


class GpuEncoder:
    """nvCOMP encoder of a GPU checkpointer; owns the compressor thread and its CUDA stream."""

    def __init__(
        self,
        codec: str,
        device: torch.device,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        group_bytes: int = DEFAULT_GROUP_BYTES,
        reprobe_every: int = DEFAULT_REPROBE_EVERY,
    ) -> None:
        if chunk_bytes < 4096 or chunk_bytes % 4096:
            raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
        self.name = f"nvcomp-{codec}"
        if device.index is None:  # the compressor thread sets its device: it needs the index
            device = torch.device(device.type, torch.cuda.current_device())
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.group_bytes = group_bytes
        self.chooser = CodecChooser(codec, reprobe_every)
        self.stream = torch.cuda.Stream(device=device)
        self.history: deque[CompressStats] = deque(maxlen=256)
        """Stats of recent snapshots, newest last (for benchmarks and logs)."""
        self.on_stats: Callable[[CompressStats], None] | None = None
        """Called on the compressor thread after each snapshot compressed without error."""
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="asyncckpt-compress", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ training thread
    def submit(self, snapshot: GpuSnapshot) -> None:
        """Queue a just-staged snapshot for compression (returns at once)."""
        self._queue.put(snapshot)

    # ------------------------------------------------------------ worker thread
    def encode_snapshot(self, snapshot: Snapshot) -> Iterator[EncodedBlob]:
        """The blobs of ``snapshot.tensors``, in order, as their groups finish compressing."""
        count = 0
        if isinstance(snapshot, GpuSnapshot):
            for group in snapshot.channel.groups():
                for _index, blob in group:
                    count += 1
                    yield blob
        else:  # a snapshot built elsewhere (convert): compress it on this thread
            for blob in self._encode_inline(list(snapshot.tensors)):
                count += 1
                yield blob
        if count != len(snapshot.tensors):
            raise RuntimeError(f"the compressor produced {count} blobs for {len(snapshot.tensors)} tensors")

    def encode(self, raw: torch.Tensor, dtype: torch.dtype, key: str) -> EncodedBlob:
        """Encode one tensor's bytes (host or device) on the calling thread; blocks until done."""
        staged = StagedTensor(
            key=key, dtype=dtype, shape=(raw.numel() // max(1, dtype.itemsize),), device=raw.device, data=raw
        )
        (blob,) = list(self._encode_inline([staged]))
        return blob

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()

    # ------------------------------------------------------------ compressor thread
    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            snapshot = self._queue.get()
            if snapshot is _STOP:
                return
            self._compress(snapshot)

    def _compress(self, snapshot: GpuSnapshot) -> None:
        stats = CompressStats(mode=snapshot.mode)
        channel, gate, began = snapshot.channel, snapshot.gate, time.perf_counter()
        error: BaseException | None = None
        try:
            with torch.cuda.stream(self.stream):
                if snapshot.ready is not None:
                    self.stream.wait_event(snapshot.ready)  # GPU-side: reads start after the save point
                if gate is not None:
                    copy_fence_stragglers(snapshot)  # on this stream, after `ready`, before the gate opens
                stats.tensors = len(snapshot.tensors)
                if snapshot.host_part is not None:
                    snapshot.host_part.wait_ready()  # device-to-host staging copies have landed
                groups = self._plan(snapshot.tensors, FENCE_GROUP_BYTES if gate is not None else self.group_bytes)
                if gate is not None:
                    works: deque[_Work] = deque()
                    for group in groups:
                        if channel.cancelled:
                            break
                        works.append(self._enqueue(group))
                    done = torch.cuda.Event()
                    done.record(self.stream)
                    gate.open(done)
                    stats.gate_seconds = time.perf_counter() - began
                    done.synchronize()
                    gate.mark_staged()
                    while works:  # popped as resolved, so each group's raw outputs are freed early
                        if not channel.put(*self._resolve(works.popleft(), stats)):
                            break
                else:
                    for group in groups:
                        if channel.cancelled or not channel.put(*self._resolve(self._enqueue(group), stats)):
                            break
        except BaseException as exc:  # noqa: BLE001 - handed to the worker through the channel
            error = exc
            log.error("asyncckpt: GPU compression failed: %s: %s", type(exc).__name__, exc)
        finally:
            snapshot.sources_final.set()  # set already unless the stragglers' copy never ran
            if gate is not None:
                gate.fail()  # a no-op once opened; otherwise training must not wait on it
            try:
                self.stream.synchronize()  # nothing may still read the snapshot once `finished` is set
            finally:
                stats.wall_seconds = time.perf_counter() - began
                self.history.append(stats)  # before close(): the save may commit as soon as the channel ends
                channel.close(error)
        if error is None and self.on_stats is not None:
            self.on_stats(stats)

    # ------------------------------------------------------------ any compressing thread
    def _encode_inline(self, tensors: list[StagedTensor]) -> Iterator[EncodedBlob]:
        stats = CompressStats(mode="inline", tensors=len(tensors))
        began = time.perf_counter()
        for group in self._plan(tensors, self.group_bytes):
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                blobs, _nbytes = self._resolve(self._enqueue(group), stats)
            for _index, blob in blobs:
                yield blob
        stats.wall_seconds = time.perf_counter() - began
        self.history.append(stats)

    def _plan(self, tensors: Sequence[StagedTensor], group_bytes: int) -> list[list[tuple[int, StagedTensor]]]:
        groups: list[list[tuple[int, StagedTensor]]] = [[]]
        size = 0
        for index, staged in enumerate(tensors):
            n = staged.data.numel()
            if groups[-1] and size + n > group_bytes:
                groups.append([])
                size = 0
            groups[-1].append((index, staged))
            size += n
        return [g for g in groups if g]

    def _enqueue(self, group: list[tuple[int, StagedTensor]]) -> _Work:
        """Queue every kernel of one group on the stream; no host wait. The stream is current."""
        work = _Work(items=[], raw=[], pendings=[], keep_alive=[])
        wanted = {}
        for index, staged in group:
            small = staged.data.numel() < MIN_COMPRESS_BYTES
            specs = () if small else self.chooser.specs_for(staged.key, staged.dtype)
            if specs:
                wanted[len(work.items)] = specs
                work.items.append((index, staged))
            else:
                work.raw.append((index, staged))
        on_device = self._on_device(work)
        by_spec: dict[CodecSpec, list[int]] = {}
        for position, specs in wanted.items():
            for spec in specs:
                by_spec.setdefault(spec, []).append(position)
        for spec, positions in by_spec.items():
            chunk = batch.chunk_bytes_for(spec, self.chunk_bytes)
            sources = [on_device[p] for p in positions]
            typestr = batch.typestr_for(spec)
            alignment = batch.required_alignment(spec, self.stream, chunk)
            wide = spec.planes > 1 and spec.planes_span == "tensor"
            if wide and any(t.numel() % spec.planes for t in sources):  # auto never asks for this
                raise ValueError(f"{spec}: a tensor is not a whole number of {spec.planes}-byte items")
            if wide:  # each plane its own aligned row, cut into chunks of its own
                sizes = [spec.planes * plane_stride(t.numel(), spec.planes) for t in sources]
                bases, total = aligned_offsets(sizes)
                planar = torch.empty(max(total, 1), dtype=torch.uint8, device=self.device)
                for t, start, size in zip(sources, bases, sizes, strict=True):
                    split_tensor_into(t, planar[start : start + size], spec.planes)
                span, keep = batch.DeviceSpan(planar.data_ptr(), total, typestr), [planar]
            elif spec.planes > 1 or any(t.data_ptr() % alignment for t in sources):
                bases, total = aligned_layout(sources)
                planar = torch.empty(total, dtype=torch.uint8, device=self.device)
                for t, offset in zip(sources, bases, strict=True):
                    split_into(t, planar[offset : offset + t.numel()], chunk, spec.planes)
                span, keep = batch.DeviceSpan(planar.data_ptr(), total, typestr), [planar]
            else:
                span, base = batch.span_of(sources, typestr)
                bases, keep = [t.data_ptr() - base for t in sources], sources
            chunk_offsets, raw_sizes, ranges = chunk_table(
                [t.numel() for t in sources], bases, chunk, spec.planes if wide else 1
            )
            pending = batch.encode(spec, span, chunk_offsets, raw_sizes, self.stream, chunk, keep)
            work.pendings.append((positions, ranges, pending))
        return work

    def _on_device(self, work: _Work) -> list[torch.Tensor]:
        """Each item's bytes on the device: uploads host-staged ones into one buffer."""
        data = [staged.data for _index, staged in work.items]
        uploads = [i for i, d in enumerate(data) if d.device.type != "cuda"]
        if uploads:
            offsets, total = aligned_layout([data[i] for i in uploads])
            buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
            work.keep_alive.append(buffer)
            for i, offset in zip(uploads, offsets, strict=True):
                target = buffer[offset : offset + data[i].numel()]
                target.copy_(data[i], non_blocking=True)  # pinned staging: an async copy on this stream
                data[i] = target
        return data

    def _resolve(self, work: _Work, stats: CompressStats) -> tuple[Group, int]:
        """Wait for a group's encodes, keep the smallest output per tensor, pack it. The stream is current."""
        options: list[list[_Option]] = [[] for _ in work.items]
        for positions, ranges, pending in work.pendings:
            sizes = pending.sizes()
            stats.gpu_seconds += pending.gpu_seconds()
            stats.encoded_bytes += sum(pending.raw_sizes)
            for position, (first, end) in zip(positions, ranges, strict=True):
                options[position].append(_Option(sum(sizes[first:end]), pending.spec, pending, first, end))
        chosen = []
        for (_index, staged), candidates in zip(work.items, options, strict=True):
            best = min(candidates, key=lambda o: o.stored)  # the first candidate wins a tie
            if len(candidates) > 1:
                self.chooser.chose(staged.key, staged.dtype, best.spec)
                stats.probed += 1
            chosen.append(best)
        # Each blob starts 16-byte aligned in `packed` (the checksum kernel reads whole words);
        # its chunks follow back to back, exactly as they go to the file.
        starts, position = [], 0
        for option in chosen:
            starts.append(position)
            position += (option.stored + PACK_ALIGN_BYTES - 1) // PACK_ALIGN_BYTES * PACK_ALIGN_BYTES
        packed = torch.empty(max(position, 1), dtype=torch.uint8, device=self.device)
        spans = [(start, start + option.stored) for start, option in zip(starts, chosen, strict=True)]
        from_addresses, to_addresses, lengths = _copy_table(chosen, starts, packed.data_ptr())
        table_on_device = kernels.copy_ranges(from_addresses, to_addresses, lengths, self.device, self.stream)
        packed_done = torch.cuda.Event()
        packed_done.record(self.stream)
        packed_done.synchronize()  # KvikIO and the checksum read the packed bytes from other streams
        del table_on_device
        total = sum(o.stored for o in chosen)
        blobs: Group = []
        for (index, staged), option, (start, end) in zip(work.items, chosen, spans, strict=True):
            sizes, lo, hi = option.pending.sizes(), option.first, option.end
            blobs.append(
                (
                    index,
                    EncodedBlob(
                        data=packed[start:end],
                        codec=option.spec.codec,
                        params=option.spec.params(),
                        chunks=list(zip(sizes[lo:hi], option.pending.raw_sizes[lo:hi], strict=True)),
                    ),
                )
            )
            stats.specs[str(option.spec)] += 1
            stats.raw_bytes += staged.data.numel()
            stats.stored_bytes += end - start
        for index, staged in work.raw:
            n = staged.data.numel()
            blobs.append((index, EncodedBlob(data=staged.data, codec="none", chunks=[(n, n)])))
            stats.specs["none"] += 1
            stats.raw_bytes += n
            stats.stored_bytes += n
        blobs.sort(key=lambda pair: pair[0])
        return blobs, total


def chunk_table(
    sizes: Sequence[int], bases: Sequence[int], chunk_bytes: int, planes: int = 1
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Offsets (from each tensor's base) and raw sizes of every chunk, and each tensor's (first, end) chunk range.

    ``planes`` > 1: tensor-wide byte planes (:func:`asyncckpt.gpu.planes.plane_chunks`), each plane
    cut into chunks of its own. Built with numpy: a group has thousands of chunks, and in ``fence``
    mode the next optimizer step waits until every group is queued.
    """
    offsets, raw, ranges, count = [], [], [], 0
    for nbytes, base in zip(sizes, bases, strict=True):
        length = nbytes // planes if planes > 1 else nbytes
        per_plane = -(-length // chunk_bytes)
        if per_plane == 0:  # nothing to compress (the pipeline stores tensors this small raw)
            ranges.append((count, count))
            continue
        within = np.arange(per_plane, dtype=np.int64) * chunk_bytes
        row = np.full(per_plane, chunk_bytes, dtype=np.int64)
        row[-1] = length - (per_plane - 1) * chunk_bytes
        if planes > 1:
            starts = np.arange(planes, dtype=np.int64) * plane_stride(nbytes, planes)
            within = (starts[:, None] + within[None, :]).reshape(-1)
            row = np.tile(row, planes)
        offsets.append(base + within)
        raw.append(row)
        ranges.append((count, count + row.size))
        count += row.size
    if not raw:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), []
    return np.concatenate(offsets), np.concatenate(raw), ranges


def _copy_table(
    chosen: Sequence[_Option], starts: Sequence[int], packed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Source addresses, destination addresses and sizes of every kept chunk (numpy, no per-chunk Python)."""
    sources, targets, sizes = [], [], []
    for option, start in zip(chosen, starts, strict=True):
        pending = option.pending
        stored = np.asarray(pending.sizes()[option.first : option.end], dtype=np.int64)
        offsets = np.asarray(pending.out_offsets[option.first : option.end], dtype=np.int64)
        sources.append(pending.out.data_ptr() + offsets)
        targets.append(packed + start + np.concatenate(([0], np.cumsum(stored)[:-1])))
        sizes.append(stored)
    if not sizes:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(sources), np.concatenate(targets), np.concatenate(sizes)
