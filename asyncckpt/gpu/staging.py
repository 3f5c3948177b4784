"""Staging on the GPU path: the device arena (``device``), fences (``fence``), pinned host (``host``).

:meth:`GpuStager.stage` runs on the training thread inside ``save()`` and never waits for the
GPU:

``device``
    One ``torch._foreach_copy_`` of every CUDA tensor into a slot of a preallocated GPU arena,
    on the caller's current stream, then an event. Later kernels on that stream are ordered
    after the copy, so the caller may mutate the state as soon as ``save()`` returns. A slot is
    allocated the first time a state needs it (one per ``max_inflight``), reused afterwards and
    registered with cuFile when GPUDirect Storage is active.
``fence``
    No copy: an event on the caller's stream, and a :class:`~asyncckpt.gpu.fence.FenceGate`
    that holds the next optimizer step on the GPU until the compressor has read the tensors.
    Non-contiguous and tiny tensors are copied (they are few and small).
``host``
    Pinned host memory (:class:`~asyncckpt.snapshot.HostStager`), for when GPU memory is short.

CPU tensors always go to host staging. ``auto`` picks ``device`` when the arena fits the GPU
staging budget, else ``fence`` when the compressed state is expected to fit, else ``host``:
a device copy costs the GPU a few milliseconds, a fence holds the next step until compression
is done (tens of milliseconds), a host copy costs PCIe time and host memory.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Sequence

import torch

from ..errors import CheckpointError
from ..snapshot import HostStager, StagedTensor
from ..tree import TensorLeaf
from . import fence
from .snapshot import BlobChannel, GpuSnapshot

log = logging.getLogger("asyncckpt")

ARENA_ALIGN_BYTES = 512
"""Start of every tensor in the arena: enough for vectorised kernels and nvCOMP inputs."""
TINY_BYTES = 4096
"""Tensors smaller than this are stored raw (see the pipeline); in fence mode they are copied at save()."""


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view (no copy)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


class DeviceArena:
    """GPU staging slots, one per in-flight save, each reused for every save that fits it."""

    def __init__(
        self,
        slots: int,
        device: torch.device,
        register: Callable[[torch.Tensor], None] | None,
        deregister: Callable[[torch.Tensor], None] | None,
    ) -> None:
        self.device = device
        self._register, self._deregister = register, deregister
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._slots: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(slots)]
        self._views: dict[int, tuple[object, list[torch.Tensor], list[torch.Tensor]]] = {}
        for i in range(slots):
            self._free.put(i)

    @staticmethod
    def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
        offsets, end = [], 0
        for t in tensors:
            offsets.append(end)
            end += (nbytes_of(t) + ARENA_ALIGN_BYTES - 1) // ARENA_ALIGN_BYTES * ARENA_ALIGN_BYTES
        return offsets, end

    def acquire(self, tensors: Sequence[torch.Tensor]) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """A free slot holding room for ``tensors``: (slot id, typed views, byte views)."""
        signature = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        slot = self._free.get()  # the caller holds an in-flight slot, so one is free
        cached = self._views.get(slot)
        if cached is not None and cached[0] == signature:
            return slot, cached[1], cached[2]
        offsets, total = self.layout(tensors)
        if self._slots[slot].numel() < total:
            self._replace(slot, total)
        arena = self._slots[slot]
        typed, raw = [], []
        for t, offset in zip(tensors, offsets, strict=True):
            piece = arena[offset : offset + nbytes_of(t)]
            raw.append(piece)
            typed.append(piece.view(t.dtype).view(t.shape) if piece.numel() else torch.empty_like(t))
        self._views[slot] = (signature, typed, raw)
        return slot, typed, raw

    def _replace(self, slot: int, nbytes: int) -> None:
        old = self._slots[slot]
        if old.numel() and self._deregister is not None:
            self._deregister(old)
        self._slots[slot] = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._views.pop(slot, None)
        del old  # give the old slot back before allocating the larger one
        self._slots[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self._register is not None:
            self._register(self._slots[slot])
        log.info("asyncckpt: GPU staging slot %d is now %d bytes", slot, nbytes)

    def release(self, slot: int) -> None:
        self._free.put(slot)

    @property
    def allocated_bytes(self) -> int:
        return sum(s.numel() for s in self._slots)

    def close(self) -> None:
        for slot in self._slots:
            if slot.numel() and self._deregister is not None:
                self._deregister(slot)
        self._slots = []
        self._views.clear()


class GpuStager:
    """Stages CUDA tensors per the snapshot mode; hands every snapshot to the compressor at once."""

    def __init__(
        self,
        mode: str,
        device: torch.device,
        slots: int,
        submit: Callable[[GpuSnapshot], None],
        window_bytes: int,
        gpu_budget_bytes: int | None = None,
        host_budget_bytes: int | None = None,
        register: Callable[[torch.Tensor], None] | None = None,
        deregister: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        if mode not in ("auto", "device", "fence", "host"):
            raise ValueError(f"snapshot mode must be auto, device, fence or host; got {mode!r}")
        self.mode = mode
        self.device = device
        self.slots = slots
        self.window_bytes = window_bytes
        self.gpu_budget_bytes = gpu_budget_bytes
        self._submit = submit
        self.arena = DeviceArena(slots, device, register, deregister)
        self.host = HostStager(slots=slots, budget_bytes=host_budget_bytes)
        self._stored_ratio = 1.0
        self.on_mode: Callable[[str], None] | None = None
        """Told the mode of each save (``auto`` resolves per save) before stage() returns."""

    # ---------------------------------------------------------------- training thread
    def stage(self, leaves: Sequence[TensorLeaf]) -> GpuSnapshot:
        on_device = [i for i, leaf in enumerate(leaves) if leaf.tensor.device == self.device]
        device_bytes = sum(nbytes_of(leaves[i].tensor) for i in on_device)
        mode = self._choose(device_bytes)
        if self.on_mode is not None:
            self.on_mode(mode)
        if mode == "host":
            on_device = []
        device_set = set(on_device)
        host_leaves = [leaf for i, leaf in enumerate(leaves) if i not in device_set]
        host_part = self.host.stage(host_leaves) if host_leaves else None
        staged: list[StagedTensor | None] = [None] * len(leaves)
        if host_part is not None:
            host_index = [i for i in range(len(leaves)) if i not in device_set]
            for i, item in zip(host_index, host_part.tensors, strict=True):
                staged[i] = item
        snapshot = GpuSnapshot(
            tensors=[],
            staging_bytes=host_part.staging_bytes if host_part else 0,
            mode=mode,
            device=self.device,
            ready=None,
            host_part=host_part,
            channel=BlobChannel(None if mode == "fence" else self.window_bytes),
        )
        try:
            if mode == "device":
                self._copy_to_arena(leaves, on_device, staged, snapshot)
            elif mode == "fence":
                self._fence(leaves, on_device, staged, snapshot)
        except BaseException:
            if host_part is not None:
                host_part.release()
            raise
        snapshot.tensors = [s for s in staged if s is not None]
        assert len(snapshot.tensors) == len(leaves)
        self._submit(snapshot)
        return snapshot

    def _choose(self, device_bytes: int) -> str:
        if self.mode != "auto":
            if self.mode == "device" and self.gpu_budget_bytes is not None:
                self._check_budget(device_bytes)
            return self.mode
        budget = self.gpu_budget_bytes
        if budget is None:
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = self.gpu_budget_bytes = free // 4
        if max(self.arena.allocated_bytes, device_bytes * self.slots) <= budget:
            return "device"
        if device_bytes * self._stored_ratio * self.slots <= budget:
            return "fence"
        return "host"

    def _check_budget(self, device_bytes: int) -> None:
        assert self.gpu_budget_bytes is not None
        if device_bytes * self.slots > self.gpu_budget_bytes:
            raise CheckpointError(
                f"snapshot='device' needs {device_bytes} bytes of GPU staging per save and max_inflight={self.slots} "
                f"saves may be in flight, but gpu_staging_budget_bytes is {self.gpu_budget_bytes}. Raise the budget "
                "(argument or ASYNCCKPT_GPU_STAGING_BUDGET_BYTES), or use snapshot='fence' or 'host'"
            )

    def _copy_to_arena(
        self,
        leaves: Sequence[TensorLeaf],
        on_device: list[int],
        staged: list[StagedTensor | None],
        snapshot: GpuSnapshot,
    ) -> None:
        sources = [leaves[i].tensor for i in on_device]
        slot, typed, raw = self.arena.acquire(sources)
        snapshot.on_release = lambda: self.arena.release(slot)
        stream = torch.cuda.current_stream(self.device)
        began, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record(stream)
        if sources:
            torch._foreach_copy_(typed, sources)
        ready.record(stream)
        snapshot.ready, snapshot.copy_timing = ready, (began, ready)
        snapshot.staging_bytes += sum(r.numel() for r in raw)
        for i, data in zip(on_device, raw, strict=True):
            staged[i] = _staged(leaves[i], data)

    def _fence(
        self,
        leaves: Sequence[TensorLeaf],
        on_device: list[int],
        staged: list[StagedTensor | None],
        snapshot: GpuSnapshot,
    ) -> None:
        for i in on_device:
            t = leaves[i].tensor
            if not t.is_contiguous() or nbytes_of(t) < TINY_BYTES:
                # Compression reads these after save() returns and writes may come later still: own a copy.
                t = t.contiguous() if not t.is_contiguous() else t.clone()
                snapshot.owned.append(t)
            staged[i] = _staged(leaves[i], bytes_view(t))
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        snapshot.ready = ready
        snapshot.gate = fence.FenceGate(self.device)
        fence.arm(snapshot.gate)

    # ---------------------------------------------------------------- worker thread
    def saw_ratio(self, raw_bytes: int, stored_bytes: int) -> None:
        """Feed back the last save's compressed size (auto uses it to size a fence's outputs)."""
        if raw_bytes:
            self._stored_ratio = min(1.0, max(0.05, stored_bytes / raw_bytes))

    def close(self) -> None:
        self.arena.close()
        self.host.close()


def _staged(leaf: TensorLeaf, data: torch.Tensor) -> StagedTensor:
    t = leaf.tensor
    return StagedTensor(key=leaf.key, dtype=t.dtype, shape=tuple(t.shape), device=t.device, data=data)
