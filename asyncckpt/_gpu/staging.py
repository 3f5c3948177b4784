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
    No copy: an event on the caller's stream, and a :class:`~asyncckpt._gpu.fence.FenceGate`
    that holds the next optimizer step on the GPU until the compressor has read the tensors.
    Non-contiguous and tiny tensors are copied by the compressor thread, on its stream, before
    the gate opens (:func:`copy_fence_stragglers`): they are few and small, and no tensor
    attribute is read for them on the training thread.
``host``
    Pinned host memory (:class:`~asyncckpt._snapshot.HostStager`), for when GPU memory is short.

CPU tensors always go to host staging. ``auto`` picks ``device`` when the arena and the
compressor's scratch fit the GPU staging budget, else ``fence``, whose compressed output stays
on the GPU up to the budget and goes to pinned host memory beyond it; :mod:`asyncckpt._gpu.budget`
decides, at every save, from the free memory measured then, and says why.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .. import _alignment as alignment
from .._snapshot import HostStager
from .._tree import FlatState
from . import fence as fence
from .budget import (
    NO_LIMIT,
    StagingPlan,
    default_gpu_budget,
    fenced_instead,
    plan_groups,
    plan_staging,
    reference_room,
    scratch_of,
    with_delta_limit,
    without_deltas,
)
from .pinned_pool import PinnedPool
from .snapshot import BlobChannel, GpuSnapshot

log = logging.getLogger("asyncckpt")

ARENA_ALIGN_BYTES = 512
"""Start of every tensor in the arena: enough for vectorised kernels and nvCOMP inputs."""
TINY_BYTES = 4096
"""Tensors smaller than this are stored raw (see the pipeline); in fence mode they are copied at save()."""


def aligned_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of ``sizes`` bytes packed into one buffer, each at a multiple of ARENA_ALIGN_BYTES; and its size."""
    return alignment.aligned_offsets(sizes, ARENA_ALIGN_BYTES)


def aligned_layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """:func:`aligned_offsets` of the tensors' byte sizes."""
    return aligned_offsets([t.nbytes for t in tensors])


def packed_views(buffer: torch.Tensor, tensors: Sequence[torch.Tensor],
                 offsets: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
    """Views of ``buffer`` (uint8) at ``offsets`` shaped like ``tensors``: (typed views to copy into, byte views)."""
    typed, raw = [], []
    for t, offset in zip(tensors, offsets, strict=True):
        piece = buffer[offset : offset + t.nbytes]
        raw.append(piece)
        typed.append(piece.view(t.dtype).view(t.shape) if piece.numel() else torch.empty_like(t))
    return typed, raw


# Dtypes whose ``_foreach_copy_`` CUDA kernel exists in every torch this project supports. The
# rest (float8/float4 kinds, uint16/32/64, complex32) are copied as same-width integers: a copy
# moves bits, so the integer view gives the same bytes and needs no kernel for the exotic dtype.
_FOREACH_COPY_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})  # fmt: skip
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copyable(t: torch.Tensor) -> torch.Tensor:
    width = t.element_size()
    if t.dtype in _FOREACH_COPY_DTYPES or width not in _SAME_WIDTH_INT or t.is_conj() or t.is_neg():
        return t
    return t.view(_SAME_WIDTH_INT[width])


def copy_all_(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for all i as one ``_foreach_copy_`` on the current stream,
    for every dtype a checkpoint may hold (same dtypes and shapes on both sides)."""
    torch._foreach_copy_([_copyable(t) for t in targets], [_copyable(s) for s in sources])


def copy_fence_stragglers(snapshot: GpuSnapshot) -> None:
    """Copy the live tensors of a ``fence`` snapshot that must not be read live, then publish its sources.

    Compressor thread, on the compressor stream, after that stream waited for ``snapshot.ready``
    and before the gate opens, so the copies read the state at the save point. A tiny tensor is
    stored raw and read at write time, after the gate opened; a non-contiguous one needs a
    contiguous copy to be compressed, and so does a conjugate or negative view. The buffer is
    allocated on the compressor stream and lives as long as the snapshot's sources. ``snapshot.tensors`` waits for this.
    """
    try:
        sources = snapshot.sources
        copies = [
            i
            for i, t in enumerate(sources)
            # Host copies are final already. A conjugate or negative view's memory holds the
            # values before that lazy operation: the copy applies it.
            if t.is_cuda and (t.nbytes < TINY_BYTES or not t.is_contiguous() or t.is_conj() or t.is_neg())
        ]
        if copies:
            live = [sources[i] for i in copies]
            offsets, total = aligned_layout(live)
            buffer = torch.empty(max(total, 1), dtype=torch.uint8, device=snapshot.device)
            typed, raw = packed_views(buffer, live, offsets)
            copy_all_(typed, live)
            for i, data in zip(copies, raw, strict=True):
                sources[i] = data
    finally:
        snapshot.sources_final.set()


ArenaSlot = tuple[int, list[torch.Tensor], list[torch.Tensor]]
"""An acquired arena slot: (slot id, typed views to copy into, byte views)."""


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

    def acquire(self, tensors: Sequence[torch.Tensor]) -> ArenaSlot:
        """A free slot holding room for ``tensors``: (slot id, typed views, byte views)."""
        signature = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        slot = self._free.get()  # the caller holds an in-flight slot, so one is free
        cached = self._views.get(slot)
        if cached is not None and cached[0] == signature:
            return slot, cached[1], cached[2]
        try:
            offsets, total = aligned_layout(tensors)
            if self._slots[slot].numel() < total:
                self._replace(slot, total)
            typed, raw = packed_views(self._slots[slot], tensors, offsets)
        except BaseException:
            self._free.put(slot)  # out of GPU memory: the slot stays usable for the next save
            raise
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

    def preallocate(self, tensors: Sequence[torch.Tensor]) -> None:
        """Size a slot for ``tensors`` now, so the first save allocates nothing. Any thread, no save in flight."""
        slot, _typed, _raw = self.acquire(tensors)
        self.release(slot)

    @property
    def allocated_bytes(self) -> int:
        return sum(s.numel() for s in self._slots)

    def close(self) -> None:
        for slot in self._slots:
            if slot.numel() and self._deregister is not None:
                self._deregister(slot)
        self._slots = []
        self._views.clear()


class ReferenceMemory(Protocol):
    """The GPU side of a delta reference store, as the stager budgets it
    (:class:`~asyncckpt._gpu.delta_store.DeviceReferenceStore`)."""

    device_bytes: int
    """GPU bytes the references hold now."""
    device_budget_bytes: int | None
    """GPU bytes they may hold: set by every plan to what they hold plus the room it leaves."""

    def give_up_device_memory(self) -> int:
        """Forget the references held on the GPU and free their memory now; the bytes freed."""
        ...


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
        fence_allowed: bool = True,
    ) -> None:
        if mode not in ("auto", "device", "fence", "host"):
            raise ValueError(f"snapshot mode must be auto, device, fence or host; got {mode!r}")
        self.mode = mode
        self.device = device
        self.slots = slots
        self.window_bytes = window_bytes
        self.fence_allowed = fence_allowed
        """False for ``codec="none"``: nothing reads a live tensor before training moves on."""
        self.gpu_budget_bytes = gpu_budget_bytes
        self._submit = submit
        self._granted_bytes = 0
        """The most GPU memory a plan has let the compressor use (scratch + resident output).
        PyTorch's caching allocator keeps what it freed, invisible to ``mem_get_info``; counted
        back as available, it keeps the next save from planning around its own cache."""
        self.arena = DeviceArena(slots, device, register, deregister)
        self.host = HostStager(slots=slots, budget_bytes=host_budget_bytes)
        self.pool = PinnedPool(self.host.budget_bytes, device=device, held_elsewhere=self.host.allocated_bytes)
        """Pinned blocks for compressed bytes a ``fence`` save cannot keep on the GPU."""
        self._one_gpu = torch.cuda.device_count() == 1
        self.forms_per_tensor = 1
        """How many encodings of one tensor the compressor may hold at once: 1, or each delta form
        beside the tensor's own bytes in an incremental save (set by the backend). A tensor larger
        than a group is encoded alone, so its scratch counts this many times."""
        self.delta_auto = False
        """``delta="auto"``: a ``fence`` save takes no deltas (:func:`~asyncckpt._gpu.budget.without_deltas`)."""
        self.on_mode: Callable[[str, str], None] | None = None
        """Told the mode of each save and why (:class:`~asyncckpt._gpu.budget.StagingPlan`) before stage() returns."""
        self.references: ReferenceMemory | None = None
        """A delta checkpointer's reference store (set by the backend): its GPU memory is part of
        the one GPU budget, and gets only what the staging leaves (:meth:`_plan`)."""

    # ---------------------------------------------------------------- training thread
    def stage(self, flat: FlatState) -> GpuSnapshot:
        """Stage the tensors of ``flat`` per the snapshot mode and hand the snapshot to the compressor.

        Training thread; queues GPU work on the caller's current stream and never waits for it.
        Reads one or two attributes per tensor (a microsecond per tensor matters against 2 ms),
        and never the keys or skeleton of ``flat``; tensors off this device are copied to host
        memory here (:meth:`~asyncckpt._snapshot.HostStager.copy`).
        """
        tensors = flat.leaf_tensors
        if self._one_gpu:  # every CUDA tensor of this process is on self.device
            here = [t.is_cuda for t in tensors]
        else:
            index = self.device.index
            here = [t.is_cuda and t.get_device() == index for t in tensors]
        plan = self._plan(tensors, here)
        acquired = None
        if plan.mode == "device":
            try:
                acquired = self.arena.acquire([t for t, on in zip(tensors, here, strict=True) if on])
            except torch.cuda.OutOfMemoryError as exc:  # the budget is an estimate; never fail the save for it
                plan = self._fence_rule(fenced_instead(plan, f"the device arena could not be allocated ({exc})",
                                                       self.fence_allowed, self.forms_per_tensor))  # fmt: skip
        mode = plan.mode
        if self.on_mode is not None:
            self.on_mode(mode, plan.reason)
        if mode == "host":
            here = [False] * len(tensors)
        sources = list(tensors)
        off_device = [i for i, on in enumerate(here) if not on]
        try:
            host_part = self.host.copy([tensors[i] for i in off_device]) if off_device else None
        except BaseException:
            if acquired is not None:
                self.arena.release(acquired[0])
            raise
        snapshot = GpuSnapshot(flat, plan, self.device, host_part, BlobChannel(plan.window_bytes), self.pool)
        if acquired is not None:
            snapshot.on_release = functools.partial(self.arena.release, acquired[0])
        if host_part is not None:
            for i, copy in zip(off_device, host_part.copies, strict=True):
                sources[i] = copy
        try:
            if acquired is not None:
                self._copy_to_arena([i for i, on in enumerate(here) if on], sources, snapshot, acquired)
            elif mode == "fence":
                self._fence(snapshot)
        except BaseException:
            if host_part is not None:
                host_part.release()
            if snapshot.on_release is not None:
                snapshot.on_release()  # the arena slot taken before the failure
            raise
        snapshot.sources = sources
        self._submit(snapshot)
        return snapshot

    def _plan(self, tensors: Sequence[torch.Tensor], here: Sequence[bool]) -> StagingPlan:
        """Decide this save's mode and memory from what is measured now (training thread).

        The default budget re-reads free GPU memory at every save: training's own use moves. Delta
        references held on the GPU stay allocated, like the arena, so they are counted as held and
        the staging is planned with the rest of the budget; they may then grow into the room that
        plan leaves (:func:`~asyncckpt._gpu.budget.reference_room`), which never changes the next
        plan's mode or compression. If the budget shrank under them (training took memory, or the
        user lowered it), they give their memory up when keeping it would cost this save its mode,
        compression or deltas, or would exceed the budget beside the arena."""
        device_bytes = largest = 0
        for t, on in zip(tensors, here, strict=True):
            if on:
                n = t.nbytes
                device_bytes += n
                largest = max(largest, n)
        references = self.references
        held = references.device_bytes if references is not None else 0
        budget = self.gpu_budget_bytes
        if budget is None:
            free, _total = torch.cuda.mem_get_info(self.device)
            # The compressor's cached scratch is reused by the next save, so it counts as available.
            budget = default_gpu_budget(free + self._granted_bytes, self.arena.allocated_bytes) + held
        plan = self._plan_within(budget - held, device_bytes, largest)
        if held and references is not None:
            without = self._plan_within(budget, device_bytes, largest)
            # Over the budget beside the arena (it shrank below them), or costing this save: give up.
            if held > budget - self.arena.allocated_bytes or _worse(plan, without, largest):
                freed = references.give_up_device_memory()
                log.info("asyncckpt: the GPU budget shrank under the delta references: %d bytes of them given "
                         "up (their tensors are stored in full until memory comes back)", freed)  # fmt: skip
                # What a background pass holds (an allocation under way, memory it is about to
                # free) is still counted, and still taken out of this save's budget.
                held = references.device_bytes
                plan = self._plan_within(budget - held, device_bytes, largest) if held else without
            else:
                plan = dataclasses.replace(plan, reason=f"{plan.reason} ({held} bytes of the budget hold delta "
                                                        "references)")  # fmt: skip
        if references is not None:
            arena = self.arena.allocated_bytes
            room = reference_room(plan, device_bytes, arena, self.slots, largest, self.forms_per_tensor)
            references.device_budget_bytes = held + room
        if plan.mode != "host":
            granted = scratch_of(plan) + plan.resident_bytes
            self._granted_bytes = max(self._granted_bytes, min(granted, plan.budget_bytes))
        return plan

    def _plan_within(self, budget: int, device_bytes: int, largest: int) -> StagingPlan:
        plan = plan_staging(
            self.mode,
            device_bytes,
            budget,
            self.arena.allocated_bytes,
            self.slots,
            largest,
            self.window_bytes,
            self.fence_allowed,
        )
        if self._takes_no_delta(plan):
            return without_deltas(plan)
        return with_delta_limit(plan, self.forms_per_tensor, largest, self.slots)

    def _takes_no_delta(self, plan: StagingPlan) -> bool:
        """``delta="auto"``'s rule: a ``fence`` save takes no delta (also one fenced after planning,
        when its arena could not be allocated)."""
        return self.delta_auto and plan.mode == "fence" and self.forms_per_tensor > 1

    def _fence_rule(self, plan: StagingPlan) -> StagingPlan:
        return without_deltas(plan) if self._takes_no_delta(plan) else plan

    def _to_arena(self, indices: list[int], sources: list[torch.Tensor], snapshot: GpuSnapshot,
                  acquired: ArenaSlot) -> tuple[torch.cuda.Event, torch.cuda.Event]:  # fmt: skip
        """Copy ``sources[i]`` (tensors on this device) for ``indices`` into the ``acquired`` arena
        slot with one ``_foreach_copy_`` on the caller's stream; ``sources[i]`` becomes the slot's
        bytes. Returns (began, ended) events."""
        tensors = [sources[i] for i in indices]
        _slot, typed, raw = acquired
        stream = torch.cuda.current_stream(self.device)
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record(stream)
        if tensors:
            copy_all_(typed, tensors)
        ended.record(stream)
        for i, data in zip(indices, raw, strict=True):
            sources[i] = data
            snapshot.staging_bytes += data.numel()
        return began, ended

    def _copy_to_arena(self, on_device: list[int], sources: list[torch.Tensor], snapshot: GpuSnapshot,
                       acquired: ArenaSlot) -> None:  # fmt: skip
        began, ended = self._to_arena(on_device, sources, snapshot, acquired)
        snapshot.ready, snapshot.copy_timing = ended, (began, ended)

    def _fence(self, snapshot: GpuSnapshot) -> None:
        # Compression reads the tensors after save() returns; the few that must not be read live
        # (tiny, non-contiguous, conjugate/negative views) are copied by the compressor
        # (copy_fence_stragglers).
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        snapshot.ready = ready
        snapshot.gate = fence.FenceGate(self.device)
        fence.arm(snapshot.gate)

    # ---------------------------------------------------------------- any thread
    def preallocate(self, flat: FlatState) -> threading.Thread:
        """Allocate, on a background thread, the staging a save of ``flat`` will need; returns the thread.

        ``fence`` saves (what ``auto`` picks on a full GPU) need pinned blocks for the compressed
        bytes that do not stay on the GPU: the raw size of the state is reserved (an upper bound
        of its compressed size; what the first save leaves unused is given back after it).
        ``device`` saves need an arena slot, allocated on that thread; ``host`` saves the pinned
        arena of :meth:`~asyncckpt._snapshot.HostStager.preallocate`. The calling thread only reads
        tensor sizes."""
        tensors = flat.leaf_tensors
        here = [t.is_cuda for t in tensors]
        plan = self._plan(tensors, here)
        on_device = [t for t, on in zip(tensors, here, strict=True) if on]
        if plan.mode == "fence":
            # Grouped as the compressor will group them (every leaf, in order); the last groups,
            # beyond what may stay on the GPU, are the ones that go to pinned blocks.
            sizes = [t.nbytes for t in tensors]
            spill = max(0, sum(sizes) - plan.resident_bytes)
            return self.pool.reserve(spilled_group_sizes(sizes, plan.group_bytes, spill))
        if plan.mode == "host":
            return self.host.preallocate(flat)  # a raw copy of every tensor into the pinned arena
        thread = threading.Thread(target=self.arena.preallocate, args=(on_device,), name="asyncckpt-prealloc",
                                  daemon=True)  # fmt: skip
        thread.start()
        return thread

    def delta_limit(self, flat: FlatState) -> int | None:
        tensors = flat.leaf_tensors
        limit = self._plan(tensors, [t.is_cuda for t in tensors]).max_delta_bytes
        return None if limit >= NO_LIMIT else limit

    def host_staging_bytes(self) -> int:
        """The raw host arena's bytes plus the pinned blocks for compressed bytes. Any thread."""
        return self.host.allocated_bytes() + self.pool.allocated_bytes

    def close(self) -> None:
        self.arena.close()
        self.host.close()
        self.pool.close()


def _worse(plan: StagingPlan, than: StagingPlan, largest_tensor_bytes: int) -> bool:
    """Whether ``plan`` runs another mode than ``than``, compresses less, or takes fewer deltas."""
    return (
        plan.mode != than.mode
        or plan.max_compress_bytes < than.max_compress_bytes
        or plan.max_delta_bytes < min(largest_tensor_bytes, than.max_delta_bytes)
    )


def spilled_group_sizes(sizes: Sequence[int], group_bytes: int, total_bytes: int) -> list[int]:
    """Raw bytes of the last groups the compressor forms from tensors of ``sizes``, as many as hold
    ``total_bytes``: the groups of a ``fence`` save that will not stay on the GPU."""
    groups = [sum(sizes[i] for i in group) for group in plan_groups(sizes, group_bytes)]
    kept: list[int] = []
    for group in reversed(groups):
        if total_bytes <= 0:
            break
        kept.append(group)
        total_bytes -= group
    return kept
