"""Host staging: copy every tensor into a reusable host memory arena.

The CPU path's snapshot, and the GPU path's ``host`` mode. One arena slot per save that may be
in flight (``max_inflight``); a slot is allocated the first time a state needs it and reused
afterwards, so steady-state saves allocate nothing. Slots are pinned when CUDA is present, so
device-to-host copies run at full PCIe/C2C bandwidth and asynchronously on the caller's stream.

Threads: :meth:`HostStager.stage` runs on the training thread; ``wait_ready``/``release`` on
the worker thread.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .._alignment import aligned_offsets
from .._tree import FlatState
from ..errors import CheckpointError
from .base import StagedAtOnce, StagedTensor, bytes_view

ALIGN_BYTES = 64
"""Each tensor starts at a multiple of 64 bytes in the arena, so typed views are aligned."""

CLONE_BYTES = 4096
"""CPU tensors up to this size are cloned instead of copied into the arena (:meth:`HostStager.copy`)."""

_CLONEABLE = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
     torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool}
)  # fmt: skip
"""Dtypes a clone allocates without trouble. Others stay in the arena, a view of bytes: allocating
complex32 warns that it is experimental, and under ``torch.use_deterministic_algorithms(True)``
(Lightning's ``deterministic=True``) a new float4 tensor fails in the fill of fresh memory."""


def _is_cloned(t: torch.Tensor) -> bool:
    """A CPU tensor small enough, of a dtype simple enough, to be cloned rather than copied into the arena."""
    return t.is_cpu and t.nbytes <= CLONE_BYTES and t.dtype in _CLONEABLE


def default_host_budget_bytes() -> int:
    """Half of physical memory, divided by the processes of this node (``LOCAL_WORLD_SIZE``, as torchrun sets it).

    Half, because the rest belongs to the OS, data loaders and the page cache the writes go
    through; per local rank, because every rank of the node stages its own share."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        physical = 16 << 30
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return physical // 2 // ranks


@dataclass
class HostCopy:
    """Copies of some tensors in host memory, taken on the training thread; no key paths.

    ``copies[i]`` has the dtype and shape ``tensors[i]`` had at the copy, in C order: a typed
    view of the stager's slot, or for a small CPU tensor a clone of its own. ``devices[i]`` is
    where the tensor lived.
    """

    copies: list[torch.Tensor]
    devices: list[torch.device]
    staging_bytes: int
    _slot: torch.Tensor
    _free: queue.SimpleQueue[torch.Tensor]
    _copies_done: list[torch.cuda.Event] = field(default_factory=list)
    _released: bool = field(default=False)

    def wait_ready(self) -> None:
        # Device-to-host copies were queued on the callers' streams; wait for them here, on the
        # worker thread, never on the training thread.
        for event in self._copies_done:
            event.synchronize()

    def gpu_busy_seconds(self) -> float:
        # D2H copies run on the copy engine alongside compute; training kernels are not held up
        # by them beyond the host time already counted as stall.
        return 0.0

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.copies = []
            self._free.put(self._slot)


class HostSnapshot(StagedAtOnce):
    """A :class:`HostCopy` of every tensor of a state; its :class:`StagedTensor` list (with the
    state's key paths) is built on first use, on the worker thread."""

    def __init__(self, copy: HostCopy, flat: FlatState) -> None:
        self.copy = copy
        self.flat = flat
        self._tensors: list[StagedTensor] | None = None

    @property
    def tensors(self) -> list[StagedTensor]:
        if self._tensors is None:
            self._tensors = [
                StagedTensor(key=leaf.key, dtype=c.dtype, shape=tuple(c.shape), device=device, data=bytes_view(c))
                for leaf, c, device in zip(self.flat.tensors, self.copy.copies, self.copy.devices, strict=True)
            ]
        return self._tensors

    @property
    def staging_bytes(self) -> int:
        return self.copy.staging_bytes

    def wait_ready(self) -> None:
        self.copy.wait_ready()

    def gpu_busy_seconds(self) -> float:
        return self.copy.gpu_busy_seconds()

    def release(self) -> None:
        self.copy.release()
        self._tensors = []


class HostStager:
    """Copies tensors into pinned (with CUDA) or pageable host memory."""

    def __init__(self, slots: int, budget_bytes: int | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.budget_bytes = default_host_budget_bytes() if budget_bytes is None else budget_bytes
        self._pin = torch.cuda.is_available()
        self._slot_bytes: dict[int, int] = {}
        """Bytes of each arena slot allocated so far, by slot data pointer (for :meth:`allocated_bytes`)."""
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for _ in range(slots):
            self._free.put(torch.empty(0, dtype=torch.uint8))

    def stage(self, flat: FlatState) -> HostSnapshot:
        """Copy every tensor of ``flat`` into host staging. Training thread; reads no key path."""
        return HostSnapshot(self.copy(flat.leaf_tensors), flat)

    def copy(self, tensors: Sequence[torch.Tensor]) -> HostCopy:
        """Copy ``tensors`` to host memory. Training thread.

        A CPU tensor of at most :data:`CLONE_BYTES` is cloned (a third of the time of a slot view
        and copy: an AdamW state on CUDA holds one 4-byte CPU ``step`` per parameter); every other
        tensor goes to one slot of the arena, pinned where CUDA exists. CUDA sources copy
        asynchronously on their device's current stream, waited for in ``wait_ready``.
        """
        cloned = [_is_cloned(t) for t in tensors]
        offsets, total = self._layout([t for t, small in zip(tensors, cloned, strict=True) if not small])
        if total * self.slots > self.budget_bytes:
            raise CheckpointError(
                f"the state needs {total} bytes of host staging per save and max_inflight={self.slots} saves may be "
                f"in flight, but host_staging_budget_bytes is {self.budget_bytes}. Raise the budget "
                "(argument or ASYNCCKPT_HOST_STAGING_BUDGET_BYTES), lower max_inflight, or stage on the GPU"
            )
        # The caller holds an in-flight slot, so a free arena slot exists: get() never waits long.
        slot = self._free.get()
        try:
            slot = self._grown(slot, total)
            copies, devices, cuda_devices, clone_bytes = [], [], set(), 0
            at = iter(offsets)
            for src, small in zip(tensors, cloned, strict=True):
                if small:
                    copy = src.clone(memory_format=torch.contiguous_format)
                    clone_bytes += copy.nbytes
                else:
                    offset = next(at)
                    copy = slot[offset : offset + src.nbytes].view(src.dtype).view(src.shape)
                    if src.is_cuda:
                        # copy_ applies a lazy conjugate/negation to the host copy at once, before an
                        # asynchronous device-to-host copy has landed (on the H200 the restored values
                        # were not negated): resolve it on the device first, on the same stream.
                        if src.is_conj() or src.is_neg():
                            src = src.resolve_conj().resolve_neg()
                        copy.copy_(src, non_blocking=True)  # pinned destination: asynchronous on the caller's stream
                        cuda_devices.add(src.device)
                    else:
                        copy.copy_(src)
                copies.append(copy)
                devices.append(src.device)
            # A device-to-host copy runs on its source device's current stream: one event per device.
            copies_done = []
            for device in cuda_devices:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                copies_done.append(event)
        except BaseException:
            self._free.put(slot)  # a failed stage (out of memory, a bad copy) must not lose the slot
            raise
        return HostCopy(copies=copies, devices=devices, staging_bytes=total + clone_bytes, _slot=slot,
                        _free=self._free, _copies_done=copies_done)  # fmt: skip

    def preallocate(self, flat: FlatState) -> threading.Thread:
        """Allocate (and pin) the arena slot a save of ``flat`` needs, on a background thread; returns it.

        Pinning tens of GB takes seconds: done here, the first save only copies. Call while no save
        is in flight (the slot is taken for the allocation)."""
        _offsets, total = self._layout([t for t in flat.leaf_tensors if not _is_cloned(t)])

        def allocate() -> None:
            slot = self._free.get()
            try:
                if total <= self.budget_bytes:
                    slot = self._grown(slot, total)
            finally:
                self._free.put(slot)

        thread = threading.Thread(target=allocate, name="asyncckpt-prealloc", daemon=True)
        thread.start()
        return thread

    def _grown(self, slot: torch.Tensor, total: int) -> torch.Tensor:
        """``slot``, or a new one of ``total`` bytes (pinned with CUDA) if it is smaller."""
        if slot.numel() >= total:
            return slot
        self._slot_bytes.pop(slot.data_ptr(), None)
        slot = torch.empty(0, dtype=torch.uint8)  # free the old slot before allocating the larger one
        slot = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin)
        self._slot_bytes[slot.data_ptr()] = total
        return slot

    def allocated_bytes(self) -> int:
        """Host bytes the arena's slots hold (any thread)."""
        return sum(self._slot_bytes.values())

    def delta_limit(self, flat: FlatState) -> int | None:
        return None  # a host copy takes a delta of any tensor (no GPU scratch to share)

    def host_staging_bytes(self) -> int:
        return self.allocated_bytes()

    @staticmethod
    def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
        return aligned_offsets((t.nbytes for t in tensors), ALIGN_BYTES)

    def close(self) -> None:
        while not self._free.empty():
            self._free.get_nowait()
