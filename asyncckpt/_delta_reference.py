"""The reference store of incremental checkpoints: each key's raw bytes at the base save.

A delta save (:mod:`asyncckpt._delta_encode`) stores a tensor as a transform against the same
key's bytes in an earlier checkpoint of the same checkpointer: the chain's last full save
(``delta_reference="full"``) or the save just before (``"previous"``). Those bytes are kept
here, not read back from disk: the worker copies every tensor a full save encodes (with
``previous``, every save) into the store (``ref := new``), and the store says which checkpoint
they belong to only once that save is committed.

Life cycle, all on the checkpoint worker thread except :meth:`invalidate`:

1. :meth:`ReferenceStore.begin` at the start of a save: the base to encode against (the last
   committed save, its manifest digest and chain depth), or None for a full save.
2. per tensor: :meth:`~ReferenceStore.reference` (the base bytes, or None: store it in full),
   then :meth:`~ReferenceStore.record` (the new bytes replace them, in place, unless the
   writer :meth:`~ReferenceStore.freeze`-d the save: a delta against the full save keeps them).
3. :meth:`~ReferenceStore.commit` once the checkpoint is committed (and, distributed, as this
   rank sees the commit); :meth:`~ReferenceStore.invalidate` on any failure (encode, write,
   commit), by ``discard_steps_after``, and whenever the store cannot vouch for its bytes: the
   next save is then full. Because a failed save always invalidates, bytes may be overwritten in
   place while a save encodes: there is never a second copy of the state.

Memory is bounded by ``budget_bytes``: a key whose bytes do not fit is not kept (it is stored in
full at every save). :class:`HostReferenceStore` keeps the bytes in host memory (the CPU path);
a GPU-memory store implements the same :class:`ReferenceStore` protocol.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Base", "HostReferenceStore", "ReferenceStore"]


@dataclass(frozen=True)
class Base:
    """The committed checkpoint a save's delta records refer to."""

    step: int
    manifest_sha256: str
    depth: int
    """How many delta saves the chain has had since its last full save (0: none yet). With
    ``delta_reference="previous"`` also how many delta checkpoints lie between the base and that
    full save; with ``"full"`` the base is that full save, whatever the depth."""


class ReferenceStore(Protocol):
    """Per key: the raw bytes of the last committed save, and that save's identity."""

    def begin(self, step: int) -> Base | None:
        """Start encoding save ``step``: the base to encode against, or None (store everything in full)."""
        ...

    def reference(self, key: str, raw_bytes: int) -> torch.Tensor | None:
        """``key``'s 1-D uint8 bytes in the base, or None when the store has none of that size."""
        ...

    def wants_full_save(self) -> bool:
        """Whether memory has arrived, since the base, for keys the base could not keep: with
        ``delta_reference="full"`` the next save is then full, so those keys get references too."""
        ...

    def freeze(self, frozen: bool) -> None:
        """Whether the save just begun leaves the base's bytes in place (a delta save against the
        chain's full save): its records then keep nothing, and its commit keeps the base."""
        ...

    def record(self, key: str, raw: torch.Tensor, *, keep: bool = True) -> None:
        """``raw`` is ``key``'s bytes in the save being encoded: keep a copy (if it fits and ``keep``)."""
        ...

    def full_size(self, key: str) -> int | None:
        """The stored size ``key`` took when it was last stored in full, if known."""
        ...

    def set_full_size(self, key: str, stored_bytes: int) -> None: ...

    def commit(self, step: int, manifest_sha256: str, has_reference: bool) -> None:
        """The save begun last is committed with this manifest digest; ``has_reference``: it holds deltas."""
        ...

    def invalidate(self) -> None:
        """Forget everything: the next save is full. Any thread."""
        ...

    def close(self) -> None:
        """Free every byte the store holds (the checkpointer is closing; no save runs)."""
        ...

    def reserve(self, sizes: dict[str, int]) -> threading.Thread | None:
        """Allocate memory for these names' bytes ahead of a save, on a thread it returns; None
        where memory is taken as a save records."""
        ...


class HostReferenceStore:
    """A :class:`ReferenceStore` in host memory, at most ``budget_bytes`` of it. Worker thread."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._bytes: dict[str, torch.Tensor] = {}
        self._full_sizes: dict[str, int] = {}
        self._touched: set[str] = set()
        self._held = 0
        self._base: Base | None = None
        self._valid_for: int | None = None
        """The step begun last, while no failure or invalidation happened since."""
        self._frozen = False
        """The save begun last keeps the base's bytes (:meth:`freeze`)."""
        self._lock = threading.RLock()  # re-entrant: a subclass's _drop and _clear take it, called with it held

    @property
    def held_bytes(self) -> int:
        return self._held

    def begin(self, step: int) -> Base | None:
        with self._lock:
            base = self._base
            self._touched = set()
            self._valid_for = step
            self._frozen = False
            if base is not None and base.step >= step:
                # A save below the base (a new timeline): a reference must be an earlier step.
                self._clear()
                return None
            return base

    def reference(self, key: str, raw_bytes: int) -> torch.Tensor | None:
        if self._base is None:
            return None
        found = self._bytes.get(key)
        return found if found is not None and found.numel() == raw_bytes else None

    def wants_full_save(self) -> bool:
        return False  # memory is taken as a save records: none arrives between saves

    def freeze(self, frozen: bool) -> None:
        self._frozen = frozen and self._base is not None

    def record(self, key: str, raw: torch.Tensor, *, keep: bool = True) -> None:
        self._touched.add(key)
        if self._frozen:
            if not keep:
                self._drop(key)
            return
        held = self._bytes.get(key)
        if keep and held is not None and held.numel() == raw.numel():
            held.copy_(raw)
            return
        self._drop(key)
        if not keep or self._held + raw.numel() > self.budget_bytes:
            return  # not kept, or does not fit: stored in full at the next save
        self._bytes[key] = raw.to("cpu", copy=True)
        self._held += raw.numel()

    def full_size(self, key: str) -> int | None:
        return self._full_sizes.get(key)

    def set_full_size(self, key: str, stored_bytes: int) -> None:
        self._full_sizes[key] = stored_bytes

    def commit(self, step: int, manifest_sha256: str, has_reference: bool) -> None:
        with self._lock:
            if self._valid_for != step:
                self._clear()  # invalidated while the save ran
                return
            if self._frozen and self._base is not None:
                # The bytes are still the full save's, which holds every key it held whatever this save
                # left out: the next delta refers to it too, one save further on.
                self._base = dataclasses.replace(self._base, depth=self._base.depth + 1)
            else:
                for key in set(self._bytes) - self._touched:
                    self._drop(key)  # gone from the state: the next save cannot refer to it
                for key in set(self._full_sizes) - self._touched:
                    del self._full_sizes[key]
                depth = self._base.depth + 1 if has_reference and self._base is not None else 0
                self._base = Base(step=step, manifest_sha256=manifest_sha256, depth=depth)
            self._valid_for = None
            self._frozen = False

    def invalidate(self) -> None:
        with self._lock:
            self._clear()

    def close(self) -> None:
        self.invalidate()

    def reserve(self, sizes: dict[str, int]) -> threading.Thread | None:
        return None  # host memory is taken as a save records, off any fence (the CPU path has none)

    def _drop(self, key: str) -> None:
        gone = self._bytes.pop(key, None)
        if gone is not None:
            self._held -= gone.numel()

    def _clear(self) -> None:
        self._held = 0
        self._bytes.clear()
        self._full_sizes.clear()
        self._base = None
        self._valid_for = None
        self._frozen = False
