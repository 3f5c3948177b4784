"""How a DCP save's writer finds the snapshot its stager made, to wait for it and release it.

``dcp.async_save(..., storage_writer=w, async_stager=s)`` hands the writer only a state dict:
the tensors the stager returned (views into its staging arena). The stager registers each
snapshot here under the storage of its arena; the writer claims the snapshots behind the
tensors it is about to write, waits until they are ready (the copy into staging has landed;
on the GPU path, a CUDA event) and releases them once its data file is durable, which frees
the staging slot for the next save. A snapshot that no writer ever claims (the save failed
before writing) is released when its staged state dict is garbage.

Thread-safe: ``register`` runs on the training thread, ``claim``/``release`` on DCP's save
thread.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from .._snapshot import Snapshot


@dataclass(eq=False)
class StagedSave:
    """One registered snapshot."""

    snapshot: Snapshot
    stall_seconds: float
    on_release: Callable[[], None]
    storages: frozenset[int] = frozenset()
    """:func:`storage_key` of each staged tensor: a tensor of these is final once the snapshot is ready."""
    claimed: bool = False
    _released: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self) -> None:
        """Give the staging memory back (idempotent; any thread)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        try:
            self.snapshot.release()
        finally:
            self.on_release()

    def release_if_unclaimed(self) -> None:
        if not self.claimed:
            _forget(self)
            self.release()


_lock = threading.Lock()
_by_storage: dict[int, StagedSave] = {}


def storage_key(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def register(snapshot: Snapshot, stall_seconds: float, on_release: Callable[[], None],
             owner: object) -> StagedSave:  # fmt: skip
    """Record ``snapshot``; ``owner`` (the staged state dict) releases it if it dies unclaimed."""
    storages = frozenset(storage_key(staged.data) for staged in snapshot.tensors if staged.data.numel())
    entry = StagedSave(snapshot=snapshot, stall_seconds=stall_seconds, on_release=on_release, storages=storages)
    with _lock:
        for key in storages:
            _by_storage[key] = entry
    weakref.finalize(owner, entry.release_if_unclaimed)
    return entry


def claim(tensors: Iterable[torch.Tensor]) -> list[StagedSave]:
    """The registered snapshots behind ``tensors``, now owned by the caller (each returned once)."""
    found: list[StagedSave] = []
    with _lock:
        for tensor in tensors:
            entry = _by_storage.get(storage_key(tensor)) if tensor.numel() else None
            if entry is not None and not entry.claimed:
                entry.claimed = True
                found.append(entry)
        for entry in found:
            _forget_locked(entry)
    return found


def _forget(entry: StagedSave) -> None:
    with _lock:
        _forget_locked(entry)


def _forget_locked(entry: StagedSave) -> None:
    for key in [k for k, v in _by_storage.items() if v is entry]:
        del _by_storage[key]


def local_tensor(value: object) -> torch.Tensor | None:
    """The tensor whose memory backs ``value`` (a DTensor's local shard), or None."""
    if not isinstance(value, torch.Tensor):
        return None
    inner = getattr(value, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else value
