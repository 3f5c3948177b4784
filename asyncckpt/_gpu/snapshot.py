"""The snapshot of a GPU save, and the channel its compressed blobs flow through.

A :class:`GpuSnapshot` is staged on the training thread (:mod:`asyncckpt._gpu.staging`),
compressed on the compressor thread (:mod:`asyncckpt._gpu.pipeline`), and written and released
by the checkpoint worker thread. :class:`BlobChannel` carries the compressed groups from the
compressor to the worker, in tensor order, and applies backpressure: outside ``fence`` mode the
compressor stops once ``window_bytes`` of compressed output wait to be written, so GPU memory
stays bounded whatever the size of the state.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._codecs.base import EncodedBlob
from .._snapshot import HostCopy, StagedTensor, bytes_view
from .._tree import FlatState, TensorLeaf
from .budget import StagingPlan
from .fence import FenceGate
from .pinned_pool import PinnedBlock, PinnedPool

Group = list[tuple[int, EncodedBlob]]
"""Blobs of consecutive tensors: (index in the snapshot, blob)."""


class BlobChannel:
    """Compressed groups from one producer (the compressor) to one consumer (the worker)."""

    def __init__(self, window_bytes: int | None) -> None:
        self.window_bytes = window_bytes
        """Queued bytes beyond which put() waits; None: never wait (fence mode)."""
        self._cond = threading.Condition()
        self._groups: deque[tuple[Group, int]] = deque()
        self._queued_bytes = 0
        self._error: BaseException | None = None
        self._closed = False
        self.cancelled = False
        self.finished = threading.Event()
        """Set once the producer no longer touches the snapshot's memory."""

    # producer
    def put(self, group: Group, nbytes: int) -> bool:
        """Queue a group; waits for room. Returns False (dropping it) if the consumer cancelled."""
        with self._cond:
            while (
                not self.cancelled
                and self.window_bytes is not None
                and self._queued_bytes
                and self._queued_bytes + nbytes > self.window_bytes
            ):
                self._cond.wait()
            if self.cancelled:
                return False
            self._groups.append((group, nbytes))
            self._queued_bytes += nbytes
            self._cond.notify_all()
            return True

    def close(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._closed = True
            self._error = error
            self._cond.notify_all()
        self.finished.set()

    # consumer
    def groups(self) -> Iterator[Group]:
        """Yield groups in order until the producer closes; raises the producer's error."""
        while True:
            with self._cond:
                while not self._groups and not self._closed:
                    self._cond.wait()
                if self._groups:
                    group, nbytes = self._groups.popleft()
                    self._queued_bytes -= nbytes
                    self._cond.notify_all()
                elif self._error is not None:
                    raise self._error
                else:
                    return
            yield group

    def cancel(self) -> None:
        with self._cond:
            self.cancelled = True
            self._groups.clear()
            self._queued_bytes = 0
            self._cond.notify_all()


class DeltaHandoff:
    """This save's incremental session, handed from the worker to the compressor.

    The worker begins a save's delta session (:meth:`~asyncckpt._delta_encode.DeltaWriter.begin`)
    when it takes the save, that is after the previous save committed or failed; the compressor
    waits for it before it reads a reference, so a delta is always against the last committed
    save. ``None`` (no delta for this save) is handed over when the save ends without one.
    """

    def __init__(self) -> None:
        self._given = threading.Event()
        self._lock = threading.Lock()
        self._session: Any = None
        """A :class:`~asyncckpt._delta_encode.DeltaSave` (not imported: the codecs it imports reach this module)."""

    def provide(self, session: Any) -> Any:
        """Worker thread (or release(), or a compressor that will not wait); the first call wins and
        is what every caller gets back."""
        with self._lock:
            if not self._given.is_set():
                self._session = session
                self._given.set()
            return self._session

    def wait(self, timeout: float | None = None) -> Any:
        """Compressor thread: the session, once the worker has provided it. After ``timeout``
        seconds without one, this save goes without deltas (None is provided, and returned)."""
        if self._given.wait(timeout):
            return self._session
        return self.provide(None)


class GpuSnapshot:
    """A snapshot whose CUDA tensors sit in the device arena (``device``), stay live (``fence``)
    or were copied to pinned memory (``host``); CPU tensors are always in host staging.

    ``stage()`` records, per leaf, where its bytes are (``sources``); the :class:`StagedTensor`
    list is built on first use of :attr:`tensors`, on the compressor thread, with the state's
    key paths, so the training thread pays for no per-tensor object it does not need. In
    ``fence`` mode the compressor replaces some sources by copies first
    (:func:`~asyncckpt._gpu.staging.copy_fence_stragglers`); :attr:`tensors` waits for that.
    """

    def __init__(self, flat: FlatState, plan: StagingPlan, device: torch.device, host_part: HostCopy | None,
                 channel: BlobChannel, pool: PinnedPool) -> None:  # fmt: skip
        self.flat = flat
        self.plan = plan
        self.mode = plan.mode
        self.device = device
        self.pool = pool
        self.pinned: list[PinnedBlock] = []
        """Pinned blocks holding compressed groups that left the GPU (appended by the compressor)."""
        self.host_part = host_part
        self.channel = channel
        self.sources: list[torch.Tensor] = []
        """Per leaf: its host copy (CPU tensors; ``host`` mode), its arena bytes (``device``) or the
        tensor itself, read live (``fence``)."""
        self.staging_bytes = host_part.staging_bytes if host_part is not None else 0
        self.ready: torch.cuda.Event | None = None
        """Recorded on the caller's stream after the snapshot copies (or at save() for fence)."""
        self.gate: FenceGate | None = None
        self.copy_timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self.on_release: Callable[[], None] | None = None
        self.delta = DeltaHandoff()
        """The incremental session of this save (used when the encoder has a delta writer)."""
        self.notes: list[str] = []
        """How the save degraded: the compressor's notes for it (``CompressStats.notes``), shared."""
        self.sources_final = threading.Event()
        """Set once ``sources`` changes no more: at once, except in fence mode (the compressor sets it)."""
        if self.mode != "fence":
            self.sources_final.set()
        self._tensors: list[StagedTensor] | None = None
        self._lock = threading.Lock()
        self._released = False

    @property
    def tensors(self) -> list[StagedTensor]:
        """One StagedTensor per leaf; compressor or worker thread (waits for the final sources)."""
        self.sources_final.wait()
        with self._lock:
            if self._tensors is None:
                self._tensors = [
                    _staged(leaf, source) for leaf, source in zip(self.flat.tensors, self.sources, strict=True)
                ]
            return self._tensors

    @property
    def stable(self) -> bool:
        """False in fence mode: ``tensors[i].data`` is live memory that training will overwrite."""
        return self.mode != "fence"

    def wait_ready(self) -> None:
        # The compressor orders its reads after `ready` on the GPU; the worker itself reads the
        # staged bytes only for tensors stored raw, so it waits here, never the training thread.
        if self.ready is not None:
            self.ready.synchronize()
        if self.host_part is not None:
            self.host_part.wait_ready()

    def when_staged(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the caller may mutate the state (fence: after the GPU read it)."""
        if self.gate is None:
            callback()
        else:
            self.gate.when_staged(callback)

    def gpu_busy_seconds(self) -> float:
        seconds = 0.0
        if self.copy_timing is not None:
            began, ended = self.copy_timing
            ended.synchronize()
            seconds += began.elapsed_time(ended) / 1e3
        if self.gate is not None:
            seconds += self.gate.gpu_wait_seconds()
        return seconds

    def release(self) -> None:
        """Stop compression (if still running), wait until it no longer reads, free the staging. Idempotent."""
        if self._released:
            return
        self._released = True
        self.delta.provide(None)  # a compressor waiting for a session that never came goes on
        self.channel.cancel()
        self.channel.finished.wait()
        if self.gate is not None:
            self.gate.fail()  # no-op when already open; never leave a training step waiting
        if self.host_part is not None:
            self.host_part.release()
        # The writer is done with the blocks (write_part releases after sync). A fence recycles even
        # when it used none: blocks reserved for groups that stayed on the GPU are freed then.
        if self.pinned or self.mode == "fence":
            self.pool.recycle(self.pinned)
        self.pinned = []
        self.sources = []
        with self._lock:
            self._tensors = []
        self.sources_final.set()  # the compressor is done with it; never leave a reader waiting
        if self.on_release is not None:
            self.on_release()


def _staged(leaf: TensorLeaf, data: torch.Tensor) -> StagedTensor:
    t = leaf.tensor
    return StagedTensor(key=leaf.key, dtype=t.dtype, shape=tuple(t.shape), device=t.device, data=bytes_view(data))
