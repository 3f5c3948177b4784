"""The snapshot plug-in interface.

A stager runs on the training thread inside ``save()``: it makes the state's bytes safe from
later mutation (a copy, or a CUDA event that later mutations wait on) and returns at once. The
worker thread then waits until the snapshot is *ready* (the copy has landed) and reads it.

Two moments matter and have different owners:

* **staged** — the caller may mutate its tensors. For host copies this is when ``stage()``
  returns; for GPU copies it is when ``stage()`` returns too, because every later kernel on
  the caller's stream is ordered after the copy.
* **ready** — the snapshot bytes may be read by another thread/stream. The worker calls
  :meth:`Snapshot.wait_ready` before it reads anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .._tree import FlatState


@dataclass(frozen=True)
class StagedTensor:
    """The snapshot of one tensor."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: torch.device
    """Where the tensor lived when saved (restored there unless ``map_location`` says otherwise)."""
    data: torch.Tensor
    """1-D uint8: the tensor's bytes in C order, host or device memory, owned by the stager."""


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view (no copy)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


class Snapshot(Protocol):
    @property
    def tensors(self) -> Sequence[StagedTensor]: ...

    @property
    def staging_bytes(self) -> int:
        """Staging memory this snapshot holds until :meth:`release`, in bytes."""
        ...

    def wait_ready(self) -> None:
        """Block the calling (worker) thread until every tensor's bytes may be read."""
        ...

    def release(self) -> None:
        """Give the staging memory back; called by the worker once the bytes are written. Idempotent."""
        ...

    def gpu_busy_seconds(self) -> float:
        """GPU time the snapshot took from training (copy kernels, fence waits), measured with CUDA
        events; 0.0 for CPU tensors. Called by the worker after ``wait_ready``."""
        ...

    @property
    def notes(self) -> Sequence[str]:
        """How this save degraded from its plan, one sentence each, in order (the GPU compressor's:
        memory ran short, the host budget was spent, tensors stored without a delta); each was also
        logged. Empty when it ran as planned. Read by the worker once the bytes are written."""
        ...

    @property
    def stable(self) -> bool:
        """Whether ``tensors[i].data`` stays as staged until :meth:`release`. False for a fence,
        whose data is live memory training overwrites once the GPU has read it: the writer then
        never re-reads it (an incompressible blob is kept as encoded)."""
        ...

    def when_staged(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (any thread) once the caller may mutate the state: at once for a copy,
        after the GPU has read the tensors for a fence. The checkpointer's handle reports
        ``staged`` through it."""
        ...


class StagedAtOnce:
    """The staging contract of a snapshot that owns its bytes when ``stage()`` returns (a copy)."""

    stable = True
    notes: Sequence[str] = ()

    def when_staged(self, callback: Callable[[], None]) -> None:
        callback()


class Stager(Protocol):
    def stage(self, flat: FlatState) -> Snapshot:
        """Snapshot the tensors of ``flat``. Runs on the training thread; must not wait for I/O.

        ``flat.leaf_tensors`` is ready; its keys and skeleton may be built on first use, so a
        stager that can do without them on the training thread should."""
        ...

    def preallocate(self, flat: FlatState) -> threading.Thread:
        """Allocate the staging a save of ``flat`` needs on a background thread (returned, started),
        so the first save allocates nothing. Any thread; reads only tensor sizes."""
        ...

    def host_staging_bytes(self) -> int:
        """Host memory the stager holds for staging now (what ``delta="auto"`` counts against its
        budget). Any thread."""
        ...

    def delta_limit(self, flat: FlatState) -> int | None:
        """The largest tensor, in bytes, a save of ``flat`` planned now could take a delta of (its
        scratch allows the delta forms); None: no limit. What ``preallocate`` reserves reference
        memory for. Any thread; reads only tensor sizes."""
        ...

    def close(self) -> None: ...
