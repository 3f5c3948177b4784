"""The GPU compression pipeline: nvCOMP on its own CUDA stream and thread, in batches.

``save()`` hands every :class:`~asyncckpt._gpu.snapshot.GpuSnapshot` to the **compressor
thread** (``asyncckpt-compress``) at once. It cuts the state into groups of about
``group_bytes`` of consecutive tensors and, per group:

1. *enqueue* (no host wait): the stream waits on the snapshot's ``ready`` event; host-staged
   tensors are uploaded; per codec spec, one byte-plane split kernel per tensor if the spec
   asks for planes, then **one** nvCOMP batched encode over every chunk of every tensor of the
   group (tensors over the chunk size are cut into chunks);
2. *resolve*: read the compressed sizes (the host waits here), keep per tensor the smallest
   candidate (``codec="auto"`` probes), pack the kept chunks back to back with one copy kernel
   (:func:`~asyncckpt._gpu.kernels.copy_ranges`) and checksum them, and hand the group to the
   worker through the snapshot's :class:`~asyncckpt._gpu.snapshot.BlobChannel`.

Group sizes come from the snapshot's :class:`~asyncckpt._gpu.budget.StagingPlan`, so the
compressor's GPU memory stays within the save's budget. In ``fence`` mode two groups are in
flight; the fence gate opens (with an event the next optimizer step waits on, on the GPU) once
every group is resolved; compressed groups beyond the plan's GPU allowance go to
pinned host memory (:meth:`GpuEncoder._compress_fenced`). Groups are packed on a stream of their
own, each behind its own encodes only (not the next group's, queued behind them), and a fence
copies them to the host on a third, which waits for the pack on the GPU: the copy engine is kept
busy while the compressor thread waits for the next group's sizes. Other modes resolve group by
group, bounded by the channel's window.

The worker thread (:func:`asyncckpt._persist.write_part`) takes the blobs in tensor order from
:meth:`GpuEncoder.encode_snapshot`, checksums and writes them while the next group compresses.
Tensors under :data:`MIN_COMPRESS_BYTES` are stored raw: nvCOMP's per-chunk overhead would
outweigh what they save.

Incremental saves (``delta="on"``/``"auto"``, :mod:`asyncckpt._delta_encode`): the compressor
waits for the save's delta session (handed over by the worker once the previous save has
committed), then for each tensor with a reference (:class:`~asyncckpt._gpu.delta_store.DeviceReferenceStore`)
also encodes its delta (:func:`~asyncckpt._delta_ops.encode_delta`, both ops until one has won
for that key) in the same batched call, keeps the smallest of every form, and once the group is
resolved copies the tensor's bytes into the store on its stream (so in ``fence`` mode before the
gate opens, and a group retried after running out of memory still finds its references intact).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._alignment import align_up
from .._codecs.base import EncodedBlob
from .._delta_encode import DeltaSave, DeltaWriter
from .._delta_ops import DELTA_OPS, encode_delta
from .._snapshot import Snapshot, StagedTensor
from ..errors import CheckpointError
from . import batch as batch
from . import kernels as kernels
from . import native as native
from .auto import DEFAULT_REPROBE_EVERY, CodecChooser
from .budget import GROUPS_IN_FLIGHT, halve, plan_groups
from .fence import FenceGate
from .planes import plane_stride, split_into, split_tensor_into
from .snapshot import BlobChannel, GpuSnapshot, Group
from .specs import CodecSpec
from .spill_reservation import SpillHistory, SpillReservation, SpillTensor
from .staging import TINY_BYTES, aligned_layout, aligned_offsets, copy_fence_stragglers

log = logging.getLogger("asyncckpt")

MIN_COMPRESS_BYTES = TINY_BYTES
DEFAULT_CHUNK_BYTES = 1 << 20
"""Raw bytes per nvCOMP chunk (RAW mode encodes each chunk as one frame)."""
DEFAULT_GROUP_BYTES = 1 << 30
"""Raw bytes per nvCOMP call for snapshots built outside a checkpointer (``convert``); saves take
theirs from their plan. Larger groups cost less host time per byte (docs/benchmarks.md)."""
MIN_RETRY_GROUP_BYTES = 4 << 20
"""Smallest group tried when GPU memory runs short mid-save; a tensor that fails alone then is stored raw."""
PACK_ALIGN_BYTES = 16
"""Start of every blob in a group's packed buffer."""
DEFAULT_WINDOW_BYTES = 1 << 30
"""Compressed bytes that may wait for the writer before the compressor pauses (not in fence mode)."""
FENCE_SESSION_WAIT_SECONDS = 0.1
"""How long a ``fence`` save waits for its delta session (the worker takes an idle save in
microseconds); past it the save is stored in full rather than holding training longer."""
DELTA_SCRATCH_FACTOR = 3
"""Groups shrink by this factor in a delta save: each tensor is encoded as itself and as up to two
delta forms, each with its own temporaries, within the scratch the plan counted for one."""

_STOP = object()


@dataclass
class _Packed:
    """A resolved group whose packing and checksums were queued on the pack stream, maybe not yet run.

    The blobs of ``packed_indices`` are views of ``buffer``, without their CRC-32s until
    :meth:`finished`; the others are the group's raw blobs (their own bytes)."""

    blobs: Group
    nbytes: int
    buffer: torch.Tensor
    done: torch.cuda.Event
    """Recorded on the packing stream after the pack and the checksums."""
    checksums: native.Crc32Batch | None
    """The CRC-32 of each packed blob, in the order of ``packed_indices``."""
    packed_indices: list[int]
    """Snapshot indices of the blobs in ``buffer`` (the group's raw blobs are not)."""
    keep_alive: list[torch.Tensor]
    """The pack's copy table, read by the kernel until ``done``."""

    def finished(self) -> Group:
        """The blobs with their CRC-32s; waits for ``done``."""
        self.done.synchronize()
        crc32s = dict(zip(self.packed_indices, _crc32_values(self.checksums, len(self.packed_indices)), strict=True))
        return [(index, blob if crc32s.get(index) is None else dataclasses.replace(blob, crc32=f"{crc32s[index]:08x}"))
                for index, blob in self.blobs]  # fmt: skip


@dataclass
class _Outgoing:
    """A fenced save's group on its way to the channel, once ``ready`` has passed on the GPU."""

    nbytes: int
    ready: torch.cuda.Event | None
    """Its pack, or its copy to pinned host memory; None: nothing left to wait for."""
    packed: _Packed | None = None
    blobs: Group = field(default_factory=list)
    """The blobs when there is no ``packed`` (a raw copy)."""
    host: torch.Tensor | None = None
    """The pinned bytes ``packed.buffer`` was copied to: the blobs are handed over as views of them."""
    copying: bool = False
    """``ready`` is a copy to pinned host memory (PCIe time), not a pack of a moment."""

    def group(self) -> Group:
        """The blobs the writer gets; waits for ``ready``."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.packed is None:
            return self.blobs
        blobs = self.packed.finished()
        if self.host is None:
            return blobs
        moved, within = [], set(self.packed.packed_indices)
        base = self.packed.buffer.data_ptr()
        for index, blob in blobs:
            if index in within:
                start = blob.data.data_ptr() - base
                blob = dataclasses.replace(blob, data=self.host[start : start + blob.stored_bytes])
            moved.append((index, blob))
        return moved


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
    group_bytes: int = 0
    """Raw bytes per group the compressor started with (the plan's; a third of it in a delta save)."""
    short_parts: int = 0
    """Parts of a staged copy whose compression ran out of GPU memory (each then retried in halves)."""
    short_smallest_bytes: int = 0
    short_raw_tensors: int = 0
    """Tensors of a staged copy stored raw because GPU memory ran short even for them alone."""
    spilled_bytes: int = 0
    """Compressed bytes copied to pinned host memory because they did not fit the GPU budget (fence)."""
    specs: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    """How this save degraded, if it did (also logged)."""

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
    delta: str | None = None
    """The delta op whose output this candidate encodes, None for the tensor's own bytes."""


@dataclass
class _Work:
    """One group between enqueue and resolve."""

    items: list[tuple[int, StagedTensor]]
    raw: list[tuple[int, StagedTensor]]
    pendings: list[tuple[list[int], list[tuple[int, int]], batch.PendingEncode, str | None]]
    keep_alive: list[torch.Tensor]
    sources: list[torch.Tensor] = field(default_factory=list)
    """Each item's bytes on the device (what a delta save records as the next reference)."""
    session: DeltaSave | None = None
    encoded: torch.cuda.Event | None = None
    """Recorded on the compressor stream after the group's last encode (what a pack on another stream waits for)."""


class GpuEncoder:
    """nvCOMP encoder of a GPU checkpointer; owns the compressor thread and its CUDA stream."""

    batched = True  # encode_snapshot compresses in batches ahead of the writer and takes delta decisions

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
        self.delta: DeltaWriter | None = None
        """Incremental saves' writer (set by the backend when ``delta`` is on); None: full saves only."""
        self._copy_stream: torch.cuda.Stream | None = None
        """Device-to-host copies of compressed groups (fence saves over the GPU budget); made on first use."""
        self._pack_stream = torch.cuda.Stream(device=device)
        """Packing and checksums, each group behind its own encodes; packed buffers come from its pool alone."""
        self._spill_history = SpillHistory()
        """What each tensor stored in the last full ``fence`` save (compressor thread): the next one's
        pinned blocks are reserved from it (:class:`~asyncckpt._gpu.spill_reservation.SpillReservation`)."""
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
        snapshot.notes = stats.notes  # one list: what the compressor notes reaches the SaveResult
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
                session = None
                if self.delta is not None:
                    # A fence holds training until this save is read: wait only for a worker that is
                    # free to take the save now, not for the previous save's write (max_inflight > 1).
                    session = snapshot.delta.wait(FENCE_SESSION_WAIT_SECONDS if gate is not None else None)
                    if session is None and gate is not None:
                        stats.notes.append("stored in full: the previous save was still being written")
                group_bytes = snapshot.plan.group_bytes
                stats.group_bytes = group_bytes
                if session is not None:
                    session.exclude_duplicates(t.key for t in snapshot.tensors)
                    session.max_delta_bytes = snapshot.plan.max_delta_bytes
                    # Each tensor's delta forms take scratch beside it (none where the plan takes no delta).
                    if session.base is not None and session.max_delta_bytes != 0:
                        group_bytes = max(MIN_RETRY_GROUP_BYTES, group_bytes // DELTA_SCRATCH_FACTOR)
                        stats.group_bytes = group_bytes
                groups = self._plan(snapshot.tensors, group_bytes)
                if gate is not None:
                    self._compress_fenced(snapshot, gate, groups, stats, began, session, group_bytes)
                else:
                    for group in groups:
                        compressed = self._compress_stable(group, snapshot, stats, session)
                        if channel.cancelled or not channel.put(*compressed):
                            break
                    if stats.short_parts:
                        note = (
                            f"GPU memory ran short while compressing: {stats.short_parts} parts failed (the smallest "
                            f"{stats.short_smallest_bytes} bytes) and were retried in halves; "
                            f"{stats.short_raw_tensors} tensors stored raw"
                        )
                        stats.notes.append(note)
                        log.warning("asyncckpt: %s", note)
                if session is not None and session.too_large:
                    note = (
                        "stored without deltas: delta='auto' takes none in a fence save (see the snapshot reason)"
                        if session.max_delta_bytes == 0 and session.writer.mode == "auto" and gate is not None
                        else f"{len(session.too_large)} tensors over {session.max_delta_bytes} bytes stored without "
                        "a delta: the GPU staging budget has no scratch for their delta forms "
                        "(raise gpu_staging_budget_bytes)"
                    )
                    stats.notes.append(note)
                    log.info("asyncckpt: %s", note)
        except BaseException as exc:  # noqa: BLE001 - handed to the worker through the channel
            error = exc
            log.error("asyncckpt: GPU compression failed: %s: %s", type(exc).__name__, exc)
        finally:
            snapshot.sources_final.set()  # set already unless the stragglers' copy never ran
            if gate is not None:
                gate.fail()  # a no-op once opened; otherwise training must not wait on it
            try:
                self.stream.synchronize()  # nothing may still read the snapshot once `finished` is set
                self._pack_stream.synchronize()
                if self._copy_stream is not None:
                    self._copy_stream.synchronize()
            finally:
                stats.wall_seconds = time.perf_counter() - began
                self.history.append(stats)  # before close(): the save may commit as soon as the channel ends
                channel.close(error)

    def _compress_fenced(
        self, snapshot: GpuSnapshot, gate: FenceGate, groups: list[list[tuple[int, StagedTensor]]],
        stats: CompressStats, began: float, session: DeltaSave | None = None, group_bytes: int | None = None,
    ) -> None:  # fmt: skip
        """Stream a ``fence`` snapshot through bounded scratch. Compressor thread; the stream is current.

        Two groups are in flight (one encoding while the previous one is resolved), so GPU memory
        stays within the plan's scratch whatever the size of the state. Each compressed group
        stays on the GPU while the plan's ``resident_bytes`` allow, else it is copied to a pinned
        block on the copy stream (overlapping the next group's encode) and written from there.
        The gate opens once every group is resolved (so a group may still be retried in smaller
        pieces when training has taken the memory the plan counted on), with an event the next
        optimizer step waits on, on the GPU.
        """
        channel = snapshot.channel
        resident_left = snapshot.plan.resident_bytes
        group_bytes = group_bytes or snapshot.plan.group_bytes
        in_flight_bytes = GROUPS_IN_FLIGHT * group_bytes
        todo = deque(groups)
        encoding: deque[tuple[list[tuple[int, StagedTensor]], _Work]] = deque()
        outgoing: deque[_Outgoing] = deque()
        retrying = False  # after running short, no auto probe: every candidate's output at once is what did not fit
        # Pinned blocks for what will spill, ahead of it, sized from what the last full save stored
        # (a delta save's tensors store far less: it neither reads nor writes that history).
        deltas = session is not None and session.base is not None and session.max_delta_bytes != 0
        reservation = SpillReservation(snapshot.pool, history=None if deltas else self._spill_history)
        raw_copied: torch.cuda.Event | None = None  # the last raw copy of a live tensor, which the gate waits for
        while (todo or encoding) and not channel.cancelled:
            enqueuing = True  # an OOM in _enqueue has one more group in flight than `encoding` holds
            try:
                # At most GROUPS_IN_FLIGHT groups' bytes in flight, and always one: a tensor larger
                # than a group is encoded alone, which is what the plan's scratch allows for.
                while todo and (not encoding or _raw_bytes(encoding) + _group_raw(todo[0]) <= in_flight_bytes):
                    encoding.append((todo[0], self._enqueue(todo[0], session, probe=not retrying)))
                    todo.popleft()
                enqueuing = False
                resolved = encoding[0][0]
                packed = self._pack(encoding[0][1], stats)
                encoding.popleft()
            except torch.cuda.OutOfMemoryError:
                # Training took the memory the plan counted on. The gate is still closed, so the
                # live tensors may be read again: retry the rest in smaller groups, then one group
                # at a time, and a tensor that does not fit alone goes raw to pinned memory.
                crowded = len(encoding) + enqueuing > 1
                retry = [g for g, _work in encoding] + list(todo)
                encoding.clear()
                retrying = True
                if group_bytes > MIN_RETRY_GROUP_BYTES:
                    group_bytes = max(MIN_RETRY_GROUP_BYTES, group_bytes // 2)
                    in_flight_bytes = GROUPS_IN_FLIGHT * group_bytes
                    flat = [pair for g in retry for pair in g]
                    todo = deque(self._plan([t for _i, t in flat], group_bytes, [i for i, _t in flat]))
                elif len(retry[0]) > 1:
                    todo = deque([[pair] for pair in retry[0]] + retry[1:])
                elif crowded and in_flight_bytes:
                    # Another group was in flight beside it: the first may fit alone.
                    in_flight_bytes = 0  # one group at a time from here
                    todo = deque(retry)
                else:
                    todo = deque(retry[1:])
                    outgoing.append(self._store_raw(snapshot, retry[0], stats))
                    raw_copied = outgoing[-1].ready or raw_copied
                    reservation.skipped(_group_raw(retry[0]))
                    continue
                note = f"GPU memory ran short while compressing: groups of {group_bytes} bytes or single tensors"
                stats.notes.append(note)
                log.warning("asyncckpt: %s", note)
                continue
            upcoming = (_spill_tensors(g) for g in itertools.chain((g for g, _work in encoding), todo))
            reservation.group_resolved(_stored_per_tensor(resolved, packed.blobs), packed.nbytes,
                                       packed.buffer.numel(), upcoming, resident_left)  # fmt: skip
            if packed.nbytes <= resident_left:
                resident_left -= packed.nbytes
                outgoing.append(_Outgoing(packed.nbytes, packed.done, packed))
            else:
                outgoing.append(self._spill(snapshot, packed, stats))
            # Hand over in order: a group that stays on the GPU at once (its pack runs behind
            # encodes already done), a copy to the host once it has landed, keeping one copy
            # in flight behind the next group's encode.
            while outgoing and (len(outgoing) > 1 or not outgoing[0].copying):
                if not self._hand_over(channel, outgoing.popleft()):
                    return
        # Every read of the live tensors is queued (and resolved): the next optimizer step may
        # run once `done` has passed on the GPU.
        self._open_gate(gate, stats, began, raw_copied)
        gate.mark_staged()
        while outgoing:
            if not self._hand_over(channel, outgoing.popleft()):
                return

    def _compress_stable(self, group: list[tuple[int, StagedTensor]], snapshot: GpuSnapshot,
                         stats: CompressStats, session: DeltaSave | None = None) -> tuple[Group, int]:  # fmt: skip
        """Compress a group of staged bytes that stay put (arena or host copies); tensors over the
        plan's ``max_compress_bytes`` are stored raw.

        When GPU memory runs short, the part that failed is split in two by bytes and each half
        tried again with one codec per tensor (no probe); the staged bytes do not change, so any
        retry is safe. A single tensor, or a part under :data:`MIN_RETRY_GROUP_BYTES`, that fails
        is stored raw. Failures are counted in ``stats`` (one note per save, see :meth:`_compress`).
        Compressor thread; the stream is current."""
        limit = snapshot.plan.max_compress_bytes
        raw = [pair for pair in group if pair[1].data.numel() > limit]
        todo = [[pair for pair in group if pair[1].data.numel() <= limit]]
        blobs: Group = []
        nbytes = 0
        retrying = False
        while todo and not snapshot.channel.cancelled:
            part = todo.pop()
            if not part:
                continue
            try:
                got, size, _packed = self._resolve(self._enqueue(part, session, probe=not retrying), stats)
            except torch.cuda.OutOfMemoryError:
                retrying = True
                size = _group_raw(part)
                stats.short_parts += 1
                stats.short_smallest_bytes = min(stats.short_smallest_bytes or size, size)
                if len(part) == 1 or size < MIN_RETRY_GROUP_BYTES:
                    raw += part
                    stats.short_raw_tensors += len(part)
                else:
                    cut = halve(_tensor_sizes(part))
                    todo += [part[cut:], part[:cut]]  # the first half next: blobs stay roughly in order
                continue
            blobs += got
            nbytes += size
        for index, staged in raw:
            blobs.append(_raw_blob(index, staged.data, stats))
            nbytes += staged.data.numel()
        blobs.sort(key=lambda pair: pair[0])
        return blobs, nbytes

    @staticmethod
    def _hand_over(channel: BlobChannel, item: _Outgoing) -> bool:
        return channel.put(item.group(), item.nbytes)

    def _store_raw(self, snapshot: GpuSnapshot, group: list[tuple[int, StagedTensor]],
                   stats: CompressStats) -> _Outgoing:  # fmt: skip
        """Copy a tensor that cannot be compressed in the GPU memory left raw to a pinned block
        (the copy engine needs no scratch). Compressor thread, before the gate opens."""
        ((index, staged),) = group
        n = staged.data.numel()
        if not staged.data.is_cuda:  # a host-staged copy is final already
            return _Outgoing(n, None, blobs=[_raw_blob(index, staged.data, stats)])
        block = snapshot.pool.acquire(n)
        if block is None:
            raise CheckpointError(
                f"tensor {staged.key!r} ({n} bytes) fits neither the free GPU memory (to compress) nor "
                f"host_staging_budget_bytes ({snapshot.pool.budget_bytes}); raise the host budget or free GPU memory"
            )
        snapshot.pinned.append(block)
        host = block.data[:n]
        copy_stream = self._copy_stream_for()
        copy_stream.wait_stream(self.stream)  # after `ready`: the bytes at the save point
        with torch.cuda.stream(copy_stream):
            host.copy_(staged.data, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(copy_stream)
        note = f"tensor {staged.key!r} stored raw: GPU memory ran short while compressing it"
        stats.notes.append(note)
        log.warning("asyncckpt: %s", note)
        stats.spilled_bytes += n
        return _Outgoing(n, copied, copying=True, blobs=[_raw_blob(index, host, stats)])

    def _open_gate(self, gate: FenceGate, stats: CompressStats, began: float,
                   raw_copied: torch.cuda.Event | None = None) -> None:  # fmt: skip
        """Open the gate behind every read of the live tensors: the encodes on this stream and the
        raw copies on the copy stream (:meth:`_store_raw`, the last of which is ``raw_copied``; the
        copy stream runs in order, so compressed groups' copies queued before it are waited for
        too, and the packs this stream waits for before reusing their inputs); mark it staged once
        they have run."""
        if raw_copied is not None:
            self.stream.wait_event(raw_copied)
        done = torch.cuda.Event()
        done.record(self.stream)
        gate.open(done)
        stats.gate_seconds = time.perf_counter() - began
        done.synchronize()

    def _spill(self, snapshot: GpuSnapshot, packed: _Packed, stats: CompressStats) -> _Outgoing:
        """Copy a resolved group's packed bytes to a pinned block, on the copy stream behind its pack
        on the GPU; its blobs are handed over as views of the block.

        When the host staging budget is spent, the group stays on the GPU and the channel gets a
        window: the rest of this save is paced by the writer (logged; the fence holds longer)."""
        block = snapshot.pool.acquire(packed.buffer.numel())
        if block is None:
            if snapshot.channel.window_bytes is None:
                snapshot.channel.window_bytes = DEFAULT_WINDOW_BYTES
                note = (
                    f"host_staging_budget_bytes ({snapshot.pool.budget_bytes}) is spent: the rest of this save is "
                    "paced by the disk, and the next optimizer step waits for it"
                )
                stats.notes.append(note)
                log.warning("asyncckpt: %s", note)
            return _Outgoing(packed.nbytes, packed.done, packed)
        snapshot.pinned.append(block)
        host = block.data[: packed.buffer.numel()]
        copy_stream = self._copy_stream_for()
        copy_stream.wait_event(packed.done)
        with torch.cuda.stream(copy_stream):
            host.copy_(packed.buffer, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(copy_stream)
        stats.spilled_bytes += packed.nbytes
        # The GPU buffer is kept (in `packed`) until the host has seen the copy land.
        return _Outgoing(packed.nbytes, copied, packed, host=host, copying=True)

    def _copy_stream_for(self) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        return self._copy_stream

    # ------------------------------------------------------------ any compressing thread
    def _encode_inline(self, tensors: list[StagedTensor]) -> Iterator[EncodedBlob]:
        stats = CompressStats(mode="inline", tensors=len(tensors))
        began = time.perf_counter()
        for group in self._plan(tensors, self.group_bytes):
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                blobs, _nbytes, _packed = self._resolve(self._enqueue(group), stats)
            for _index, blob in blobs:
                yield blob
        stats.wall_seconds = time.perf_counter() - began
        self.history.append(stats)

    def _plan(self, tensors: Sequence[StagedTensor], group_bytes: int,
              indices: Sequence[int] | None = None) -> list[list[tuple[int, StagedTensor]]]:  # fmt: skip
        """Groups of (index, tensor); ``indices`` are the tensors' indices in the snapshot (default: positions)."""
        at = range(len(tensors)) if indices is None else indices
        groups = plan_groups([staged.data.numel() for staged in tensors], group_bytes)
        return [[(at[i], tensors[i]) for i in group] for group in groups]

    def _enqueue(self, group: list[tuple[int, StagedTensor]], session: DeltaSave | None = None,
                 probe: bool = True) -> _Work:  # fmt: skip
        """Queue every kernel of one group on the stream; no host wait. The stream is current.

        With a delta ``session``, each tensor's delta forms are encoded beside its own bytes.
        ``probe=False`` (a retry after GPU memory ran short): one codec per form, no ``auto`` probe."""
        work = _Work(items=[], raw=[], pendings=[], keep_alive=[], session=session)
        wanted = {}
        choose = self.chooser.specs_for if probe else self.chooser.spec_without_probe
        for index, staged in group:
            small = staged.data.numel() < MIN_COMPRESS_BYTES
            specs = () if small else choose(staged.key, staged.dtype)
            if specs:
                wanted[len(work.items)] = specs
                work.items.append((index, staged))
            else:
                work.raw.append((index, staged))
        on_device = self._on_device(work)
        work.sources = on_device
        forms: list[dict[str | None, torch.Tensor]] = [{None: t} for t in on_device]
        form_specs: dict[int, tuple[CodecSpec, ...]] = {}
        if session is not None:
            for position, (_index, staged) in enumerate(work.items):
                deltas = _delta_forms(session, staged, on_device[position])
                if deltas:  # delta bytes get their own codec choice (their planes differ from the tensor's)
                    forms[position].update(deltas)
                    work.keep_alive.extend(deltas.values())
                    form_specs[position] = choose(_delta_key(staged.key), staged.dtype)
        by_spec: dict[tuple[CodecSpec, str | None], list[int]] = {}
        for position, specs in wanted.items():
            for op in forms[position]:
                for spec in specs if op is None else form_specs[position]:
                    by_spec.setdefault((spec, op), []).append(position)
        for (spec, op), positions in by_spec.items():
            chunk = batch.chunk_bytes_for(spec, self.chunk_bytes)
            sources = [forms[p][op] for p in positions]
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
            work.pendings.append((positions, ranges, pending, op))
        work.encoded = torch.cuda.Event()
        work.encoded.record(self.stream)
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

    def _resolve(self, work: _Work, stats: CompressStats) -> tuple[Group, int, torch.Tensor]:
        """Wait for a group's encodes, keep the smallest output per tensor, pack it: (blobs, packed
        bytes, the packed buffer the compressed blobs are views of). The stream is current."""
        packed = self._pack(work, stats)
        return packed.finished(), packed.nbytes, packed.buffer

    def _pack(self, work: _Work, stats: CompressStats) -> _Packed:
        """Wait for a group's compressed sizes, keep the smallest output per tensor, and queue its
        packing and checksums on the pack stream (no wait for them). The compressor stream is current.

        The pack waits only for this group's encodes, not for the next group's queued behind them,
        and the compressor stream waits for the pack to have read the encoders' outputs before it
        reuses their memory; a fence's copy to pinned memory waits on the GPU for ``done``, so the
        copy engine never waits for the compressor thread."""
        options: list[list[_Option]] = [[] for _ in work.items]
        for positions, ranges, pending, op in work.pendings:
            sizes = pending.sizes()
            stats.gpu_seconds += pending.gpu_seconds()
            stats.encoded_bytes += sum(pending.raw_sizes)
            for position, (first, end) in zip(positions, ranges, strict=True):
                options[position].append(_Option(sum(sizes[first:end]), pending.spec, pending, first, end, op))
        chosen, settled = [], []
        for (_index, staged), candidates in zip(work.items, options, strict=True):
            own = [o for o in candidates if o.delta is None]
            best = min(candidates, key=lambda o: o.stored)  # the first candidate wins a tie
            if best.delta is not None and best.stored >= staged.data.numel():
                best = min(own, key=lambda o: o.stored)  # a delta must beat the raw bytes too
            if len(own) > 1:
                self.chooser.chose(staged.key, staged.dtype, min(own, key=lambda o: o.stored).spec)
                stats.probed += 1
            deltas = [o for o in candidates if o.delta is not None]
            if len({o.spec for o in deltas}) > 1:
                self.chooser.chose(_delta_key(staged.key), staged.dtype, min(deltas, key=lambda o: o.stored).spec)
            settled.append((staged, candidates, best))
            chosen.append(best)
        # Each blob starts 16-byte aligned in `packed` (KvikIO's and the copies' fast paths);
        # its chunks follow back to back, exactly as they go to the file.
        starts, position = [], 0
        for option in chosen:
            starts.append(position)
            position += align_up(option.stored, PACK_ALIGN_BYTES)
        stream = self._pack_stream
        if work.encoded is None:
            raise RuntimeError("a group was packed before its encodes were queued")
        stream.wait_event(work.encoded)
        with torch.cuda.stream(stream):  # from the pack stream's pool, which only packed buffers use
            packed = torch.empty(max(position, 1), dtype=torch.uint8, device=self.device)
        spans = [(start, start + option.stored) for start, option in zip(starts, chosen, strict=True)]
        from_addresses, to_addresses, lengths = _copy_table(chosen, starts, packed.data_ptr())
        table_on_device = kernels.copy_ranges(from_addresses, to_addresses, lengths, self.device, stream)
        outputs_read = torch.cuda.Event()  # the outputs, freed into the compressor stream's pool, are read by then
        outputs_read.record(stream)
        self.stream.wait_event(outputs_read)
        checksums = _enqueue_crc32(packed, starts, [o.stored for o in chosen], stream)
        done = torch.cuda.Event()
        done.record(stream)  # KvikIO and the host copy read the packed bytes from other streams after it
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
                        delta=option.delta,
                    ),
                )
            )
            stats.specs[str(option.spec)] += 1
            stats.raw_bytes += staged.data.numel()
            stats.stored_bytes += end - start
        for index, staged in work.raw:
            blobs.append(_raw_blob(index, staged.data, stats))
        blobs.sort(key=lambda pair: pair[0])
        if work.session is not None:  # resolved (no retry can follow): learn, and update the references
            for staged, candidates, best in settled:
                _settle_delta(work.session, staged, candidates, best)
            _record_references(work.session, work.items, work.sources)
        packed_indices = [index for index, _staged in work.items]
        return _Packed(blobs, total, packed, done, checksums, packed_indices, [table_on_device])


def _enqueue_crc32(packed: torch.Tensor, starts: list[int], sizes: list[int],
                   stream: torch.cuda.Stream) -> native.Crc32Batch | None:  # fmt: skip
    """The CRC-32 of every packed blob in one nvCOMP launch on ``stream``, behind the packing copy.

    None when nvCOMP 6 is missing or the GPU has no room for the small tables: the writer then
    checksums each blob itself (:func:`asyncckpt._persist.blob_checksum`).
    """
    if not starts or not native.crc32_available():
        return None
    try:
        addresses = packed.data_ptr() + np.asarray(starts, dtype=np.int64)
        return native.crc32(addresses, np.asarray(sizes, dtype=np.int64), stream)
    except (torch.OutOfMemoryError, RuntimeError):  # no room for the tables; the library refused the batch
        return None


def _crc32_values(checksums: native.Crc32Batch | None, count: int) -> list[int | None]:
    """The CRC-32 of each packed blob, or None for all (the writer then checksums on the host) when
    nvCOMP did not run or reported a failed buffer: a checksum problem never fails a save."""
    if checksums is not None:
        try:
            return list(checksums.values())
        except RuntimeError as exc:
            log.warning("asyncckpt: nvCOMP CRC-32 failed (%s); the writer checksums these blobs on the host", exc)
    return [None] * count


def _delta_key(key: str) -> str:
    """The name ``auto`` remembers a tensor's delta codec under (a user key that happens to equal it
    only shares which codec is tried first, never what is stored)."""
    return f"{key}\0delta"


def _delta_forms(session: DeltaSave, staged: StagedTensor, source: torch.Tensor) -> dict[str | None, torch.Tensor]:
    """The delta forms of ``source`` to encode beside it: none without a reference, else the op
    that won for this key since the last full save, or both until one has. Queued on the current stream."""
    writer, name = session.writer, session.reference_key(staged)
    if session.base is None or name is None or name in writer.losers:
        return {}
    if session.max_delta_bytes is not None and source.numel() > session.max_delta_bytes:
        session.too_large.add(name)
        return {}
    reference = writer.store.reference(name, source.numel())
    if reference is None:
        return {}
    chosen = writer.ops.get(name)
    return {op: encode_delta(source, reference, op, staged.dtype) for op in ((chosen,) if chosen else DELTA_OPS)}


def _settle_delta(session: DeltaSave, staged: StagedTensor, candidates: list[_Option], best: _Option) -> None:
    """Remember what this save learnt about a tensor: its full size, the op that won, whether its delta pays."""
    writer, key = session.writer, session.reference_key(staged)
    if key is None:
        return
    own = [o.stored for o in candidates if o.delta is None]
    if own:
        writer.store.set_full_size(key, min(own))
    deltas = [o for o in candidates if o.delta is not None]
    if not deltas:
        return
    writer.ops[key] = str(min(deltas, key=lambda o: o.stored).delta)
    if best.delta is not None:
        session.deltas += 1
    elif writer.mode == "auto":
        writer.losers.add(key)  # not tried (nor kept) again until the next full save


def _record_references(session: DeltaSave, items: list[tuple[int, StagedTensor]], sources: list[torch.Tensor]) -> None:
    """Copy each tensor's bytes into the reference store, on the current stream (after the kernels
    that read the old references). A key ``auto`` gave up on is dropped instead, and so is one
    over this save's ``max_delta_bytes`` in a save that copies references: its delta forms have no
    scratch at this budget, and its reference would hold memory (tens of GB of pinned host memory on
    a full GPU) for nothing. A dropped key has no reference, never a stale one. A delta save against
    the chain's full save neither drops nor asks memory for a key over its own limit or dropped so
    by the full save (``DeltaWriter.too_large``): the budget is re-read at every save, and a limit
    that moved would otherwise have memory come for the key, and with it a full save
    (``wants_full_save``), which could drop it again."""
    writer, limit = session.writer, session.max_delta_bytes
    for (_index, staged), source in zip(items, sources, strict=True):
        name = session.reference_key(staged)
        if name is None:
            continue
        too_large = limit is not None and source.numel() > limit
        if session.against_full_save and (too_large or name in writer.too_large):
            continue  # the full save's bytes stay as they are, or the key has none
        if too_large:
            writer.too_large.add(name)
        gave_up = writer.mode == "auto" and name in writer.losers
        writer.store.record(name, source, keep=not (gave_up or too_large))


def _raw_blob(index: int, data: torch.Tensor, stats: CompressStats) -> tuple[int, EncodedBlob]:
    """A tensor's bytes stored as they are (codec ``none``), counted in ``stats``."""
    n = data.numel()
    stats.specs["none"] += 1
    stats.raw_bytes += n
    stats.stored_bytes += n
    return index, EncodedBlob(data=data, codec="none", chunks=[(n, n)])


def _tensor_sizes(group: list[tuple[int, StagedTensor]]) -> list[int]:
    return [staged.data.numel() for _index, staged in group]


def _spill_tensors(group: list[tuple[int, StagedTensor]]) -> list[SpillTensor]:
    return [SpillTensor(staged.key, staged.dtype, staged.data.numel()) for _i, staged in group]


def _stored_per_tensor(group: list[tuple[int, StagedTensor]], blobs: Group) -> list[tuple[SpillTensor, int]]:
    """Each tensor of a resolved group with the bytes it stores (what the reservation learns from)."""
    stored = {index: blob.stored_bytes for index, blob in blobs}
    return list(zip(_spill_tensors(group), [stored[index] for index, _staged in group], strict=True))


def _group_raw(group: list[tuple[int, StagedTensor]]) -> int:
    return sum(_tensor_sizes(group))


def _raw_bytes(encoding: deque[tuple[list[tuple[int, StagedTensor]], _Work]]) -> int:
    return sum(_group_raw(group) for group, _work in encoding)


def chunk_table(
    sizes: Sequence[int], bases: Sequence[int], chunk_bytes: int, planes: int = 1
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Offsets (from each tensor's base) and raw sizes of every chunk, and each tensor's (first, end) chunk range.

    ``planes`` > 1: tensor-wide byte planes (:func:`asyncckpt._gpu.planes.plane_chunks`), each plane
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
