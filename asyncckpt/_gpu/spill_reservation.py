"""Pinned blocks reserved ahead of a ``fence`` save's spilled groups, sized by what each will store.

A ``fence`` save whose compressed groups do not fit its GPU budget copies each one to a pinned host
block (:mod:`asyncckpt._gpu.pinned_pool`). A first save finds the pool empty, and pinning a block on
the compressor thread holds training (8.7 s for 28 GB on an H100), so blocks are pinned ahead on
the pool's threads, in the order the compressor will ask for them. A block must hold a group's
*compressed* bytes, which are known only once the group is encoded; before that they are estimated.

The estimate: each tensor's raw bytes times the ratio (stored/raw) seen so far in this save for the
tensors of its class and size (the same tensor of the layers before it), else for its class, over
their latest bytes (a ratio may drift through a trained model's layers). The size matters where a
class mixes tensors that compress differently: a 64 MiB tensor stored raw (1.0x) between 1 GiB
matrices (0.8x) of one class was estimated at the matrices' ratio, came out over its block and took
the one pinned for the next matrix, which then pinned another (1.84x the blocks needed; 1.05x with
sizes, ``tests/test_spill_reservation.py``). Taking a free block sized for a larger group is left
to the pool to decide: making it wait for a block of its own size instead cost later saves and
preallocated pools far more pinning on the fence (a review of that attempt, 58994ce).
A class is the leaf of the tensor's key with its dtype (``weight``, ``exp_avg``, ``exp_avg_sq``, ...):
the classes of training state compress differently (on the 1B demo model, FP32 weights 1.17x and
Adam's first moment 1.11x, ``docs/benchmarks.md``), and a state dict lists them in runs (every
weight, then each parameter's moments in turn). A class not seen yet takes the ratio of the whole
save so far.

Why not one ratio for the save: taken once from the first group (as first built), the 2.8B model's
first save held 30.4 GB of extra host memory for 26.0 GB stored (1.17x; H100, 2026-12-06,
``benchmarks/results/full_gpu-20261206-223835-h10080gbhbm3.md``), where blocks sized to the stored
groups hold about 1.07x (1/16 headroom and 2 MiB alignment, :func:`~asyncckpt._gpu.pinned_pool.block_size_for`).

Why a window: only the next :data:`RESERVE_AHEAD_BYTES` (estimated) are asked for, topped up when
half is used, so what a wrong estimate can pin in excess is bounded by the window, and a group is
estimated once it is near, when more of its class has been seen. The window keeps the pool's
threads busy: the compressor resolves a ~100 MB group in a few milliseconds, a thread pins one in
tens (15.5 GB/s on eight threads, ``pinned_pool``), so pinning, not the window, paces a first save.
An estimate is covered only by a block with a new block's headroom (``PinnedPool.cover``'s
``estimated_from``): a group may come out a few percent over its estimate, and a block that fits
only the estimate would have the compressor pin one of its own while the fence holds. A group that
comes out over every block there is gets one of its size at once, ahead of the queue.

A later save knows more: what each tensor stored the last time (:class:`SpillHistory`, kept by the
compressor from one ``fence`` save to the next). A tensor seen then is estimated at those bytes,
scaled by how this save's tensors of its class (else all of them) compare with theirs so far, and
such an estimate is covered by a free block 1/:data:`KNOWN_MARGIN_DIVISOR` over it (a new block
has 1/16 headroom and 2 MiB rounding): asked for a new block's full headroom, as a class-ratio
estimate is, a group whose bytes had grown by a fraction of a percent missed its own block of the
last save whenever that crossed a 2 MiB step; a block was pinned for it, the group took its old one
(the smallest that fits) and the new one was freed unused at the save's end. In a CPU model of
2-6B states (``benchmarks/results/repin-20261207-cpu.py.txt``) later saves pinned and freed
0.2-2.8 GB each, as the H100 runs showed (0.76-1.53 GB of extra host memory in later saves,
``docs/benchmarks.md``); with the last save's sizes and the pool keeping a slightly larger unused
block in place of a used one (``PinnedPool.recycle``), none.

Compressor thread only (one object per ``fence`` save); the pinning runs on the pool's threads.
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .pinned_pool import PinnedPool, block_size_for

KNOWN_MARGIN_DIVISOR = 32
"""An estimate from the last save's bytes is covered by a free block 1/32 over it: this save's
tensors differ from the last save's by about 1% (H100 runs, docs/benchmarks.md)."""
RESERVE_AHEAD_BYTES = 2 << 30
"""Estimated stored bytes reserved beyond the groups resolved so far (topped up at half)."""
CLASS_RATIO_BYTES = 32 << 20
"""How many of a class's latest raw bytes its ratio is taken over (and at least its latest tensor).
Small against a large model's tensors, so a drifting ratio is followed within a tensor or two:
with 256 MiB, a class of 16-64 MiB tensors stepping from 0.5x to 0.9x wasted up to 3.8 GiB of pinned
blocks, 1.3 GiB over the window's bound (tests/test_spill_reservation.py's drift test). Large
against what one small tensor weighs, so a norm's weight between two matrices barely moves it."""


@dataclass(frozen=True)
class SpillTensor:
    """What the estimate needs of one tensor of a group: its class and raw bytes."""

    key: str
    dtype: torch.dtype
    raw_bytes: int


@functools.lru_cache(maxsize=1 << 16)  # asked per tensor per window during the fence; keys repeat every save
def tensor_class(key: str, dtype: torch.dtype) -> tuple[str, torch.dtype]:
    """The last non-numeric part of a flattened key (``optim/state/3/exp_avg`` -> ``exp_avg``,
    ``model/layers.0.mlp.weight`` -> ``weight``, ``model/params.7`` -> ``params``) with the dtype:
    a numbered leaf (a ``ParameterList``) would make every tensor a class of its own."""
    parts = key.replace(".", "/").split("/")
    return next((p for p in reversed(parts) if not p.isdigit()), key), dtype


@dataclass
class _ClassRatio:
    """Stored/raw of one class over its latest :data:`CLASS_RATIO_BYTES` raw bytes (and at least its
    latest tensor): a class whose ratio drifts through the save (as a trained model's layers may)
    is followed once that many bytes of it have passed, and neither a small tensor (a norm's
    weight, stored raw at 1.0x between two matrices of 0.8x) nor one large one (an embedding in
    the ``weight`` class) outweighs the bytes around it for longer than that. Weighing every tensor
    alike, as d838d1d did, had each small one pull the next matrix's estimate halfway to 1.0x:
    blocks pinned too large (1.11x the blocks needed in ``tests/test_spill_reservation.py``; the
    likely cause of the 1.34x pinned for the stored bytes on the H200, docs/benchmarks.md)."""

    latest: deque[tuple[int, int]] = field(default_factory=deque)
    """(raw, stored) bytes of the class's latest tensors, oldest first."""
    raw: int = 0
    stored: int = 0

    def add(self, raw_bytes: int, stored_bytes: int) -> None:
        self.latest.append((raw_bytes, stored_bytes))
        self.raw += raw_bytes
        self.stored += stored_bytes
        while self.raw - self.latest[0][0] >= CLASS_RATIO_BYTES:
            raw, stored = self.latest.popleft()
            self.raw -= raw
            self.stored -= stored

    @property
    def ratio(self) -> float:
        return self.stored / self.raw


TensorId = tuple[str, torch.dtype, int]
"""A tensor as the history knows it: key, dtype and raw bytes (a tensor whose size changed is new)."""


@dataclass
class SpillHistory:
    """What each tensor stored in the last ``fence`` save, for the next one's estimates.

    Owned by the compressor (one per encoder) and read and written on its thread only. Holds the
    tensors of one save: each save's reservation starts a new record, so tensors that left the
    state are forgotten."""

    stored: dict[TensorId, int] = field(default_factory=dict)


@dataclass
class SpillReservation:
    """One ``fence`` save's reservation; :meth:`group_resolved` after each group is resolved."""

    pool: PinnedPool
    ahead_bytes: int = RESERVE_AHEAD_BYTES
    history: SpillHistory | None = None
    """The last save's bytes per tensor (read), then this save's (written as groups resolve)."""
    _classes: dict[tuple[str, torch.dtype], _ClassRatio] = field(default_factory=dict)
    """Stored/raw per class over its latest bytes (:class:`_ClassRatio`)."""
    _sizes: dict[tuple[str, torch.dtype, int], _ClassRatio] = field(default_factory=dict)
    """Stored/raw per class and raw size (the same tensor of every layer): asked first."""
    _seen_raw: int = 0
    _seen_stored: int = 0
    """Raw and stored bytes of every tensor resolved so far: the ratio of a class not seen yet."""
    _resolved_raw: int = 0
    """Raw bytes of the groups resolved so far (a position in the save's tensor order)."""
    _asked_raw: int = 0
    """Raw bytes, from the start of the save, whose groups have been asked for (0: none yet)."""
    _asked_ahead: list[tuple[int, int]] = field(default_factory=list)
    """(raw end position, estimated bytes) of the groups the window has reached and that are not yet
    resolved (spilling or not): it is topped up when these fall under half of it."""
    _last: dict[TensorId, int] = field(default_factory=dict)
    """The history's bytes of the last save (this save's replace them in the history)."""
    _again: dict[tuple[str, torch.dtype] | None, list[int]] = field(default_factory=dict)
    """Per class (and None: all), the stored bytes in the last save and in this one of the tensors
    resolved so far that both have: how far this save has moved from the last."""

    def __post_init__(self) -> None:
        if self.history is not None:
            self._last, self.history.stored = self.history.stored, {}

    def estimate(self, tensors: Iterable[SpillTensor]) -> int:
        """Estimated stored bytes of a group not yet encoded (its raw bytes while nothing is known)."""
        return self._estimate(tensors)[0]

    def _estimate(self, tensors: Iterable[SpillTensor]) -> tuple[int, bool]:
        """The estimate, and whether every tensor's comes from the last save (a near one)."""
        whole = self._seen_stored / self._seen_raw if self._seen_raw else 1.0
        total, known = 0.0, True
        for t in tensors:
            last = self._last.get((t.key, t.dtype, t.raw_bytes))
            if last is None:
                known = False
                total += t.raw_bytes * self._ratio(t, whole)
            else:
                # A class's own drift where this save has seen it (one class may move far, as Adam's
                # moments do early in training), else the whole save's.
                last_bytes, now_bytes = self._again.get(tensor_class(t.key, t.dtype)) or self._again.get(None) or (1, 1)
                total += last * now_bytes / last_bytes
        return max(1, math.ceil(total)), known

    def _ratio(self, tensor: SpillTensor, unseen: float) -> float:
        """Stored/raw of the tensors of ``tensor``'s class and size, else of its class; ``unseen`` for a
        class not seen yet in this save."""
        leaf = tensor_class(tensor.key, tensor.dtype)
        seen = self._sizes.get((*leaf, tensor.raw_bytes)) or self._classes.get(leaf)
        return unseen if seen is None else seen.ratio

    def group_resolved(self, stored: list[tuple[SpillTensor, int]], nbytes: int, packed_bytes: int,
                       upcoming: Iterable[list[SpillTensor]], resident_left: int) -> None:  # fmt: skip
        """Learn from a resolved group (each tensor with the bytes it stores) and top the reservation up.

        ``nbytes``: what the group stores (the compressor's measure of whether it stays on the GPU);
        ``packed_bytes``: its packed size (its block, if it spills); ``upcoming``: the groups after it,
        in order (read only as far as the window needs); ``resident_left``: GPU bytes the plan still
        lets stay, before this group takes its share. The compressor keeps a group on the GPU while
        it fits what is left; a later group, smaller, may still stay after one has spilled, so the
        window asks for a block for it (one block over, at most, per such group)."""
        seen = len(self._classes)
        for t, n in stored:
            self._resolved_raw += t.raw_bytes
            tensor_id = (t.key, t.dtype, t.raw_bytes)
            if self.history is not None:
                self.history.stored[tensor_id] = n
            last = self._last.get(tensor_id)
            if last:
                for drift in (self._again.setdefault(tensor_class(t.key, t.dtype), [0, 0]),
                              self._again.setdefault(None, [0, 0])):  # fmt: skip
                    drift[0] += last
                    drift[1] += n
            if t.raw_bytes:
                self._seen_raw += t.raw_bytes
                self._seen_stored += n
                leaf = tensor_class(t.key, t.dtype)
                self._classes.setdefault(leaf, _ClassRatio()).add(t.raw_bytes, n)
                self._sizes.setdefault((*leaf, t.raw_bytes), _ClassRatio()).add(t.raw_bytes, n)
        self._asked_ahead = [(end, n) for end, n in self._asked_ahead if end > self._resolved_raw]
        new_class = len(self._classes) > seen  # the window ahead was estimated without it: re-estimate now
        if self._asked_raw and not new_class and sum(n for _end, n in self._asked_ahead) >= self.ahead_bytes // 2:
            if nbytes > resident_left:  # it spills: a block for it now if none fits (it came out over its estimate)
                self.pool.cover([max(1, packed_bytes)], estimated_from=1)
            return
        # The whole window, this group's block and those asked for before included: cover() pins
        # only what the free and pending blocks cannot stand in for, and a block asked for an
        # upcoming group must not be counted as covering another.
        sizes: list[int] = []
        least: list[int] = []
        if nbytes <= resident_left:
            resident_left -= nbytes
        else:
            resident_left = 0
            sizes.append(max(1, packed_bytes))  # acquired once this returns: still free now
        exact = len(sizes)
        position, ahead = self._resolved_raw, 0
        for group in upcoming:
            if ahead >= self.ahead_bytes:
                break
            position += sum(t.raw_bytes for t in group)
            size, known = self._estimate(group)
            ahead += size
            if position > self._asked_raw:  # counted for the top-up, whether it spills or stays
                self._asked_ahead.append((position, size))
            if size <= resident_left:
                resident_left -= size  # stays on the GPU, as the compressor decides
                continue
            resident_left = 0
            sizes.append(size)
            least.append(size + size // KNOWN_MARGIN_DIVISOR if known else block_size_for(size))
        self._asked_raw = max(self._asked_raw, position)
        if sizes:
            self.pool.cover(sizes, estimated_from=exact, least_blocks=least)

    def skipped(self, raw_bytes: int) -> None:
        """A tensor of ``raw_bytes`` left the save's order without a group (stored raw after GPU
        memory ran short): it moves the position the window is counted from."""
        self._resolved_raw += raw_bytes
