"""Incremental (delta) saves: which tensors to store as a delta, and against what.

Policy (``delta`` and ``delta_full_every`` in :class:`~asyncckpt.options.CheckpointOptions`):

* A save's reference (``delta_reference``) is the last full save of the same checkpointer
  (``full``, the default: a restore reads at most two checkpoints per tensor) or the save just
  before it (``previous``: a chain, each delta against the one before), if it committed.
  Every ``delta_full_every``-th save of a chain is full, as is the first save of a checkpointer,
  the first after a failed save or ``discard_steps_after``, and ``save(..., full=True)``. (A save
  also stores in full every key its store has no memory for yet: on the GPU path, whose store
  allocates after a commit, every key of a checkpointer's first save.) So with ``previous`` a
  restore reads at most ``delta_full_every`` checkpoints per tensor.
* Per tensor, the delta (:func:`~asyncckpt._delta_ops.encode_delta`, then the usual codec) is kept
  only when its blob is smaller than the tensor's blob when it was last stored in full;
  otherwise the tensor is re-encoded in full. The op (``xor`` or ``sub``) is chosen per key at
  the first delta after a full save (both are tried; the smaller wins) and reused until the next
  full save.
* ``on``: every tensor whose reference fits the store's budget is tried at every delta save.
  ``auto``: as ``on``, but a key whose delta lost is neither tried nor kept in the store (its
  memory freed) until the next full save, and the store's budget is the host staging budget
  less what the save being encoded stages.

Used by :func:`asyncckpt._persist.write_part` on the checkpoint worker thread, for encoders that
encode one tensor at a time (the CPU path); the GPU pipeline (:mod:`asyncckpt._gpu.pipeline`)
gets the same session through the snapshot and applies the same policy in its batched encode.
References are kept per key and dtype (:meth:`DeltaSave.reference_key`), so a key whose dtype
changed is stored in full.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch

from ._codecs import EncodedBlob, Encoder, NoneCodec
from ._delta_ops import DELTA_OPS, encode_delta
from ._delta_reference import Base, ReferenceStore
from ._manifest import Reference
from ._manifest_digest import unseal
from ._snapshot import StagedTensor
from ._tree import TensorLeaf
from .errors import CorruptCheckpointError
from .options import MAX_DELTA_FULL_EVERY, CheckpointOptions

__all__ = ["DeltaSave", "DeltaWriter", "MAX_FULL_EVERY", "build_delta_writer", "reference_name"]

MAX_FULL_EVERY = MAX_DELTA_FULL_EVERY

_identity = NoneCodec()


def reference_name(key: str, dtype: torch.dtype) -> str:
    """The name a tensor's bytes are kept under in a reference store: its key and dtype."""
    return f"{key}\0{dtype}"


def duplicate_keys(keys: Iterable[str]) -> set[str]:
    """The keys that name more than one tensor (``{"a/b": x, "a": {"b": y}}``): they get no reference."""
    return {key for key, n in Counter(keys).items() if n > 1}


class DeltaWriter:
    """One checkpointer's delta policy and reference store. Worker thread, except :meth:`invalidate`."""

    def __init__(self, store: ReferenceStore, mode: str, full_every: int, budget_bytes: int,
                 reference: str = "full") -> None:  # fmt: skip
        self.store = store
        self.mode = mode
        self.full_every = full_every
        self.reference = reference
        """``full`` (deltas against the chain's full save) or ``previous`` (against the save before)."""
        self.budget_bytes = budget_bytes
        self.ops: dict[str, str] = {}
        """The op chosen per key since the last full save."""
        self.losers: set[str] = set()
        """``auto``: keys whose delta lost since the last full save (not tried, not kept)."""
        self.too_large: set[str] = set()
        """GPU path: keys the last full save kept no reference of, for its delta size limit
        (``DeltaSave.max_delta_bytes``); the saves of its chain ask no memory for them."""

    def begin(self, step: int, *, full: bool = False, staging_bytes: int = 0) -> DeltaSave:
        """Start encoding save ``step``: a full one if asked, if the chain is long or there is no base."""
        self._share_host_budget(staging_bytes)
        base = self.store.begin(step)
        if self.reference == "full" and base is not None and self.store.wants_full_save():
            base = None  # memory came for keys the full save could not keep: a new full save fills it
        if full or base is None or base.depth + 1 >= self.full_every:
            base = None
            self.ops.clear()
            self.losers.clear()
            self.too_large.clear()
        # Against the chain's full save, a delta save leaves the store's bytes as they are.
        self.store.freeze(base is not None and self.reference == "full")
        return DeltaSave(self, base)

    def invalidate(self) -> None:
        """The next save is full (a save failed, or checkpoints were discarded). Any thread."""
        self.store.invalidate()

    def close(self) -> None:
        """Free the reference store's memory. Once no save runs any more."""
        self.store.close()

    def reserve(self, leaves: Iterable[TensorLeaf], staging_bytes: int = 0,
                max_bytes: int | None = None) -> threading.Thread | None:  # fmt: skip
        """Allocate the store's memory for these tensors ahead of the first save (``preallocate``):
        the thread doing it, or None where the store allocates as it records. ``staging_bytes``:
        host staging memory already held, which ``auto`` counts against its budget as
        :meth:`begin` does; ``max_bytes``: larger tensors are left out (their save would keep no
        reference: ``DeltaSave.max_delta_bytes``). Any thread, while no save is in flight."""
        self._share_host_budget(staging_bytes)
        leaves = list(leaves)
        duplicates = duplicate_keys(leaf.key for leaf in leaves)
        return self.store.reserve({reference_name(leaf.key, leaf.tensor.dtype): leaf.tensor.nbytes
                                   for leaf in leaves if leaf.key not in duplicates
                                   and (max_bytes is None or leaf.tensor.nbytes <= max_bytes)})  # fmt: skip

    def _share_host_budget(self, staging_bytes: int) -> None:
        """``auto``: the store gets the host budget less the staging memory held beside it."""
        if self.mode == "auto" and hasattr(self.store, "budget_bytes"):
            self.store.budget_bytes = max(0, self.budget_bytes - staging_bytes)


class DeltaSave:
    """The delta decisions of one save. Worker thread."""

    def __init__(self, writer: DeltaWriter, base: Base | None) -> None:
        self.writer = writer
        self.base = base
        self.deltas = 0
        """Records stored as deltas so far."""
        self.excluded: set[str] = set()
        """Keys stored in full with no reference kept (:meth:`exclude_duplicates`)."""
        self.max_delta_bytes: int | None = None
        """Set by the GPU path: tensors over this many bytes get no delta in this save (its GPU
        budget has no scratch for their delta forms); None: no limit."""
        self.too_large: set[str] = set()
        """Keys stored in full this save for :attr:`max_delta_bytes`."""

    @property
    def against_full_save(self) -> bool:
        """Whether this save takes deltas against the chain's full save, whose bytes the store keeps
        as they are (frozen): its records copy nothing."""
        return self.base is not None and self.writer.reference == "full"

    @property
    def reference(self) -> Reference | None:
        """The manifest's ``reference``: the base, if any record is a delta."""
        if self.base is None or not self.deltas:
            return None
        return Reference(step=self.base.step, manifest_sha256=self.base.manifest_sha256)

    def exclude_duplicates(self, keys: Iterable[str]) -> None:
        """Store in full, and keep no reference for, every key that names more than one tensor in
        this save (``{"a/b": x, "a": {"b": y}}``): a base record is found by its key, so a delta
        against either would be ambiguous to a reader."""
        self.excluded = duplicate_keys(keys)

    def reference_key(self, staged: StagedTensor) -> str | None:
        """The name ``staged``'s bytes are kept under in the store (its key and dtype: a reference of
        another dtype is never used), or None when it may have no reference in this save."""
        if staged.key in self.excluded:
            return None
        return reference_name(staged.key, staged.dtype)

    def encode(self, encoder: Encoder, staged: StagedTensor, stable: bool = True) -> EncodedBlob:
        """``staged``'s blob: a delta when one wins, else in full; records its bytes as the next reference."""
        raw, key, dtype = staged.data, staged.key, staged.dtype
        store, writer, name = self.writer.store, self.writer, self.reference_key(staged)
        blob = self._try_delta(encoder, staged, name) if raw.numel() and name is not None else None
        if blob is None:
            blob = encoder.encode(raw, dtype, key)
            if blob.codec != "none" and blob.stored_bytes >= raw.numel() and stable:
                blob = _identity.encode(raw, dtype, key)  # incompressible: store raw
            if name is not None:
                store.set_full_size(name, blob.stored_bytes)
        if name is not None:
            store.record(name, raw, keep=not (writer.mode == "auto" and name in writer.losers))
        return blob

    def _try_delta(self, encoder: Encoder, staged: StagedTensor, name: str) -> EncodedBlob | None:
        if self.base is None or name in self.writer.losers:
            return None
        store, key = self.writer.store, name
        reference, full = store.reference(key, staged.data.numel()), store.full_size(key)
        if reference is None or full is None:
            return None
        chosen = self.writer.ops.get(key)
        best: EncodedBlob | None = None
        for op in (chosen,) if chosen else DELTA_OPS:
            transformed = encode_delta(staged.data, reference, op, staged.dtype)
            blob = encoder.encode(transformed, staged.dtype, staged.key)
            if blob.codec != "none" and blob.stored_bytes >= transformed.numel():
                blob = _identity.encode(transformed, staged.dtype, staged.key)
            if best is None or blob.stored_bytes < best.stored_bytes:
                best = replace(blob, delta=op)
        assert best is not None and best.delta is not None
        self.writer.ops[key] = best.delta
        if best.stored_bytes < min(full, staged.data.numel()):
            self.deltas += 1
            return best
        if self.writer.mode == "auto":
            self.writer.losers.add(key)
        return None

    def committed(self, step: int, manifest: bytes | str | None, has_reference: bool) -> None:
        """The save is committed with this manifest (its file's bytes, or its digest): its bytes become
        the next save's reference. Never raises: the checkpoint is committed whatever happens here."""
        try:
            digest = unseal(manifest, f"step {step}") if isinstance(manifest, bytes) else manifest
        except CorruptCheckpointError:
            digest = None
        if digest is None:
            self.writer.invalidate()
            return
        self.writer.store.commit(step, digest, has_reference)


def build_delta_writer(options: CheckpointOptions,
                       store: Callable[[int], ReferenceStore] | None = None) -> DeltaWriter | None:  # fmt: skip
    """The incremental-save state for ``options`` (None with ``delta="off"``). ``store`` builds the
    reference store from the host staging budget (default: :class:`HostReferenceStore`, host
    memory; the GPU path passes its device-memory store). Any thread (it allocates nothing yet)."""
    if options.delta == "off":
        return None
    from ._delta_reference import HostReferenceStore
    from ._snapshot.host import default_host_budget_bytes

    budget = options.host_staging_budget_bytes
    if budget is None:
        budget = default_host_budget_bytes()
    built = (store or HostReferenceStore)(budget)
    return DeltaWriter(built, options.delta, options.delta_full_every, budget, options.delta_reference)
