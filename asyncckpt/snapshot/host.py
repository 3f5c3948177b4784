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
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointError
from ..tree import FlatState, TensorLeaf
from .base import StagedTensor

ALIGN_BYTES = 64
"""Each tensor starts at a multiple of 64 bytes in the arena, so typed views are aligned."""


def default_host_budget_bytes() -> int:
    """Half of physical memory."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError):
        return 8 << 30


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class HostSnapshot:
    tensors: list[StagedTensor]
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
            self._free.put(self._slot)


class HostStager:
    """Copies tensors into pinned (with CUDA) or pageable host memory."""

    def __init__(self, slots: int, budget_bytes: int | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.budget_bytes = default_host_budget_bytes() if budget_bytes is None else budget_bytes
        self._pin = torch.cuda.is_available()
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for _ in range(slots):
            self._free.put(torch.empty(0, dtype=torch.uint8))

    def _layout(self, leaves: Sequence[TensorLeaf]) -> tuple[list[int], int]:
        offsets, end = [], 0
        for leaf in leaves:
            offsets.append(end)
            end += (tensor_bytes(leaf.tensor) + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
        return offsets, end

    def stage(self, flat: FlatState) -> HostSnapshot:
        """Copy every tensor of ``flat`` into host staging. Training thread."""
        return self.stage_leaves(flat.tensors)

    def stage_leaves(self, leaves: Sequence[TensorLeaf]) -> HostSnapshot:
        """Copy ``leaves`` into one slot of host staging (pinned where CUDA exists); CUDA sources copy
        asynchronously on their device's current stream, waited for in ``wait_ready``. Training thread."""
        offsets, total = self._layout(leaves)
        if total * self.slots > self.budget_bytes:
            raise CheckpointError(
                f"the state needs {total} bytes of host staging per save and max_inflight={self.slots} saves may be "
                f"in flight, but host_staging_budget_bytes is {self.budget_bytes}. Raise the budget "
                "(argument or ASYNCCKPT_HOST_STAGING_BUDGET_BYTES), lower max_inflight, or stage on the GPU"
            )
        # The caller holds an in-flight slot, so a free arena slot exists: get() never waits long.
        slot = self._free.get()
        try:
            if slot.numel() < total:
                slot = torch.empty(0, dtype=torch.uint8)  # free the old slot before allocating the larger one
                slot = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin)
            staged, cuda_devices = [], set()
            for leaf, offset in zip(leaves, offsets, strict=True):
                src = leaf.tensor
                nbytes = tensor_bytes(src)
                raw = slot[offset : offset + nbytes]
                if nbytes:
                    # non_blocking only matters for CUDA sources (pinned destination); CPU copies are synchronous.
                    raw.view(src.dtype).view(src.shape).copy_(src, non_blocking=src.is_cuda)
                if src.is_cuda:
                    cuda_devices.add(src.device)
                staged.append(StagedTensor(key=leaf.key, dtype=src.dtype, shape=tuple(src.shape), device=src.device,
                                           data=raw))  # fmt: skip
            # A device-to-host copy runs on its source device's current stream: one event per device.
            copies_done = []
            for device in cuda_devices:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                copies_done.append(event)
        except BaseException:
            self._free.put(slot)  # a failed stage (out of memory, a bad copy) must not lose the slot
            raise
        return HostSnapshot(tensors=staged, staging_bytes=total, _slot=slot, _free=self._free,
                            _copies_done=copies_done)  # fmt: skip

    def close(self) -> None:
        while not self._free.empty():
            self._free.get_nowait()
