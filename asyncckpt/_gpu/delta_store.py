"""The reference store of incremental checkpoints on the GPU path: the previous save's bytes kept
in GPU memory while a budget allows, else in pinned host memory.

Same life cycle and protocol as :class:`~asyncckpt._delta_reference.HostReferenceStore` (begin,
reference, record, commit, invalidate); only where a key's bytes live differs:

* in GPU memory, up to ``device_budget_bytes`` (default: a quarter of the GPU memory free when
  the first reference is kept). A delta then costs one elementwise kernel and the update one
  device-to-device copy (~2 TB/s on an H200);
* past that, in pinned host memory, up to ``host_budget_bytes``: the compressor uploads the
  reference to compute the delta and copies the new bytes back, both on its stream (~50 GB/s
  each way over PCIe);
* past both, not kept: that key is stored in full at every save.

Streams: :meth:`record` enqueues its copy on the calling thread's current stream (the
compressor's), after the kernels that read the old bytes, and never waits for it; the compressor
synchronises its stream before a save can commit. Allocation runs on the compressor thread; a
GPU out-of-memory error while allocating makes that key "not kept", never a failed save.
"""

from __future__ import annotations

import torch

from .._delta_reference import HostReferenceStore

__all__ = ["DeviceReferenceStore"]


class DeviceReferenceStore(HostReferenceStore):
    """A reference store for CUDA tensors: device memory first, then pinned host memory."""

    def __init__(self, device: torch.device, host_budget_bytes: int, device_budget_bytes: int | None = None) -> None:
        super().__init__(host_budget_bytes)
        self.device = device
        self.device_budget_bytes = device_budget_bytes
        self.device_bytes = 0
        """Bytes of references held in GPU memory (the rest of ``held_bytes`` is pinned host memory)."""

    def reference(self, key: str, raw_bytes: int) -> torch.Tensor | None:
        """``key``'s bytes on this device (uploaded on the current stream when kept on the host)."""
        found = super().reference(key, raw_bytes)
        if found is None or found.is_cuda:
            return found
        return found.to(self.device, non_blocking=True)

    def record(self, key: str, raw: torch.Tensor, *, keep: bool = True) -> None:
        self._touched.add(key)
        held = self._bytes.get(key)
        if keep and held is not None and held.numel() == raw.numel():
            held.copy_(raw, non_blocking=True)
            return
        self._drop(key)
        if not keep:
            return
        copy = self._allocate(raw.numel())
        if copy is None:
            return  # fits nowhere: stored in full at every save
        copy.copy_(raw, non_blocking=True)
        self._bytes[key] = copy
        self._held += raw.numel()
        if copy.is_cuda:
            self.device_bytes += raw.numel()

    def _allocate(self, nbytes: int) -> torch.Tensor | None:
        if self.device_budget_bytes is None:
            self.device_budget_bytes = torch.cuda.mem_get_info(self.device)[0] // 4
        if self.device_bytes + nbytes <= self.device_budget_bytes:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError:
                pass  # training holds the memory the budget counted on: try the host
        if self._held - self.device_bytes + nbytes <= self.budget_bytes:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # the host cannot pin that much now: not kept, never a failed save
                return None
        return None

    def _drop(self, key: str) -> None:
        gone = self._bytes.get(key)
        if gone is not None and gone.is_cuda:
            self.device_bytes -= gone.numel()
        super()._drop(key)

    def _clear(self) -> None:
        super()._clear()
        self.device_bytes = 0
