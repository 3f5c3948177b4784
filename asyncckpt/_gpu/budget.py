"""How a GPU save fits in memory: the snapshot mode, the compressor's group size, the scratch it may hold.

Pure arithmetic over sizes in bytes, decided on the training thread inside ``save()`` from what
it measures then (free GPU memory, the state's size, the host budget) and recorded with the
snapshot, so a :class:`~asyncckpt.result.SaveResult` says which mode ran and why.

The compressor never holds more GPU memory than its scratch: it compresses the state in groups
of ``group_bytes`` of consecutive tensors, each costing at most :data:`SCRATCH_PER_RAW_BYTE` times
its raw size. A ``fence`` keeps :data:`GROUPS_IN_FLIGHT` groups' bytes in flight (one encoding
while the previous one is resolved; a tensor larger than that alone); staged copies that stay put
(``device``, ``host``) are compressed one group at a time (nvCOMP's outputs for every
``auto`` candidate, a byte-plane copy, the packed result, an upload buffer, allocator slack).
Compressed groups stay on the GPU while they fit ``resident_bytes``; the rest goes to pinned
host memory (:mod:`asyncckpt._gpu.pinned_pool`), bounded by the host staging budget.

Modes:

``device``
    The whole state copied into an arena at ``save()``. When the arena plus the compressor's
    scratch fits the budget, or when earlier saves allocated the arena already (it stays
    allocated, so it costs nothing more; the compressor gets what the budget leaves beside it);
    otherwise the save runs as ``fence`` and says so.
``fence``
    Nothing copied; the next ``optimizer.step()`` waits until the compressor has read every
    tensor. Works at any state size: memory is the scratch, plus compressed bytes kept on the GPU
    up to ``resident_bytes``, plus pinned host memory for the rest.
``host``
    A raw copy into pinned host memory: when asked for, when not even the scratch of the
    smallest groups fits, or for ``codec="none"`` (which cannot be fenced). Tensors too large to
    compress within the budget are then stored raw (``max_compress_bytes``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

SCRATCH_PER_RAW_BYTE = 8
"""GPU scratch per raw byte of a group in flight: up to three ``auto`` candidates' outputs (each
bounded a little above the raw size), a byte-plane copy, the packed result, an upload buffer for
host-staged tensors, and slack for PyTorch's caching allocator, which keeps freed blocks."""
GROUPS_IN_FLIGHT = 2
"""Groups a ``fence`` compressor has in flight; a staged copy's compressor has one."""
MIN_GROUP_BYTES = 16 << 20
"""Below this, per-call overheads dominate (~0.6 ms host time per nvCOMP call)."""
MAX_GROUP_BYTES = 1 << 30
NO_LIMIT = 1 << 62
FREE_FRACTION = 4
"""The default GPU budget is the arena already held plus free memory divided by this, re-read at every save."""


@dataclass(frozen=True)
class StagingPlan:
    """What one GPU save may use; sizes in bytes."""

    mode: str
    """``device``, ``fence`` or ``host``: what runs."""
    reason: str
    """Why, in one sentence (lands in ``SaveResult.snapshot_reason`` and the log)."""
    budget_bytes: int
    """GPU memory this save may hold beyond the live state (arena + scratch + resident output)."""
    group_bytes: int
    """Raw bytes of consecutive tensors compressed per nvCOMP call (a larger tensor is a group alone)."""
    resident_bytes: int
    """Compressed bytes that may stay on the GPU until written (``fence``); beyond, they go to pinned host memory."""
    window_bytes: int | None = None
    """Compressed bytes that may wait on the GPU for the writer (``device``, ``host``); None: no window (``fence``)."""
    max_compress_bytes: int = NO_LIMIT
    """Tensors larger than this are stored raw: compressing them would need more scratch than the budget."""
    lone_scratch_bytes: int = 0
    """Scratch the plan counts for a tensor compressed alone (what sets ``max_delta_bytes``)."""
    max_delta_bytes: int = NO_LIMIT
    """In a delta save, tensors larger than this are encoded in full only: their delta forms, each
    with scratch of its own, would need more than the budget (set by :func:`with_delta_limit`)."""


def group_bytes_for(scratch_bytes: int) -> int:
    """The largest group whose scratch, :data:`GROUPS_IN_FLIGHT` at a time, fits ``scratch_bytes``."""
    group = scratch_bytes // (SCRATCH_PER_RAW_BYTE * GROUPS_IN_FLIGHT)
    return max(MIN_GROUP_BYTES, min(MAX_GROUP_BYTES, group))


def plan_groups(sizes: Sequence[int], group_bytes: int) -> list[list[int]]:
    """Indices of consecutive tensors of ``sizes`` bytes compressed together, about ``group_bytes``
    raw bytes per group; a tensor larger than that is a group of its own."""
    groups: list[list[int]] = [[]]
    size = 0
    for index, n in enumerate(sizes):
        if groups[-1] and size + n > group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += n
    return [g for g in groups if g]


def halve(sizes: Sequence[int]) -> int:
    """Where to cut consecutive tensors of ``sizes`` bytes (at least two) into two parts of about
    equal bytes: the cut index, between 1 and ``len(sizes) - 1``."""
    if len(sizes) < 2:
        raise ValueError(f"cannot split {len(sizes)} tensors in two")
    total, running = sum(sizes), 0
    for index, n in enumerate(sizes[:-1]):
        running += n
        if 2 * running >= total:
            return index + 1
    return len(sizes) - 1


def scratch_for(group_bytes: int, in_flight: int = GROUPS_IN_FLIGHT) -> int:
    """GPU scratch of ``in_flight`` groups of ``group_bytes`` raw bytes."""
    return group_bytes * SCRATCH_PER_RAW_BYTE * in_flight


def copy_group_bytes_for(scratch_bytes: int) -> int:
    """The largest group whose scratch, one group at a time, fits ``scratch_bytes`` (0: none fits)."""
    return min(MAX_GROUP_BYTES, max(0, scratch_bytes) // SCRATCH_PER_RAW_BYTE)


def scratch_of(plan: StagingPlan) -> int:
    """GPU scratch the compressor of a save run by ``plan`` may hold, a tensor larger than a group aside."""
    return scratch_for(plan.group_bytes, GROUPS_IN_FLIGHT if plan.mode == "fence" else 1)


def default_gpu_budget(available_bytes: int, arena_bytes: int = 0) -> int:
    """The budget when the user set none: the staging arena already allocated, plus a quarter of
    the memory a save could still take (``available_bytes``: free now, plus this checkpointer's
    cached compressor scratch).

    The arena stays allocated in every mode, so it is not taken from training again; counting it
    inside the quarter instead left no scratch at all beside an arena allocated while more memory
    was free, and such saves were stored uncompressed."""
    return arena_bytes + max(0, available_bytes) // FREE_FRACTION


def with_delta_limit(plan: StagingPlan, forms: int, largest_tensor_bytes: int, slots: int) -> StagingPlan:
    """``plan`` (from :func:`plan_staging`) with the ``max_delta_bytes`` its scratch room gives
    ``forms`` encodings of a lone tensor (a delta save: the tensor itself and its delta forms);
    larger tensors are stored in full in that save.

    A ``fence`` plan's room is its budget less the arena; what delta forms take of it comes out of
    the compressed output it keeps on the GPU (``resident_bytes``), which only saves PCIe time."""
    if forms <= 1:
        return plan
    per_byte = SCRATCH_PER_RAW_BYTE * forms
    if plan.mode == "fence":
        left = plan.resident_bytes * max(1, slots) + plan.lone_scratch_bytes
        limit = left // per_byte
        scratch = max(plan.lone_scratch_bytes, min(largest_tensor_bytes, limit) * per_byte)
        return dataclasses.replace(plan, max_delta_bytes=limit, resident_bytes=(left - scratch) // max(1, slots),
                                   lone_scratch_bytes=scratch)  # fmt: skip
    return dataclasses.replace(plan, max_delta_bytes=min(plan.max_compress_bytes, plan.lone_scratch_bytes // per_byte))


def without_deltas(plan: StagingPlan) -> StagingPlan:
    """``plan`` taking no delta in any tensor (``max_delta_bytes`` 0): what ``delta="auto"`` does
    in a ``fence`` save, whose references a fence's budget leaves no GPU room for.

    Why: a delta is computed on the GPU against the tensor's reference, so a reference held in
    pinned host memory crosses PCIe (to the GPU, and its update back in a full save) while the
    fence holds the optimizer step: its raw bytes, where the delta saves a fraction of its
    compressed bytes (1.17x to 1.5x on FP32 weights: about a seventh of the raw bytes). Measured on
    a full GPU (2.8B parameters, 10 GB free, H100, 2026-12-06, ``docs/benchmarks.md``): delta saves
    stored 1.199x where delta off stored 1.199x beside them, and lost 0.11-0.23 s more training per
    save. ``delta="on"`` still takes them. The reference memory goes too: every key is over the
    limit, so a full save keeps no reference (``pipeline._record_references``)."""
    return dataclasses.replace(
        plan,
        max_delta_bytes=0,
        reason=f"{plan.reason}; delta='auto' takes no delta in a fence save (its references would cross PCIe "
        "while the fence holds training)",
    )


def reference_room(plan: StagingPlan, device_bytes: int, arena_bytes: int, slots: int,
                   largest_tensor_bytes: int, forms: int) -> int:  # fmt: skip
    """GPU bytes of ``plan``'s budget that delta references may take: what is left once the arena
    (allocated, or to be allocated by a ``device`` copy), the writer's window, the compressor's
    scratch (its groups, the largest tensor compressed, ``forms`` encodings of a tensor up to
    ``max_delta_bytes``) and a ``fence``'s resident output are counted. The resident output is not
    room although it only saves PCIe time: references are allocated by a background pass that may
    run while the save planned here is still filling it.

    References held on the GPU are taken out of the next save's budget (as the arena is, they stay
    allocated), and a save planned with this much less budget keeps its mode, its compression and
    the delta forms of every tensor it had them for (``tests/test_staging_budget.py`` searches for a
    counterexample). A ``host`` save leaves no room: it already had too little memory to compress.
    """
    if plan.mode == "host":
        return 0
    lone_delta = min(largest_tensor_bytes, plan.max_delta_bytes) * SCRATCH_PER_RAW_BYTE * forms if forms > 1 else 0
    if plan.mode == "fence":
        scratch = max(scratch_for(plan.group_bytes), largest_tensor_bytes * SCRATCH_PER_RAW_BYTE, lone_delta)
        return max(0, plan.budget_bytes - arena_bytes - scratch - plan.resident_bytes * max(1, slots))
    arena = max(arena_bytes, device_bytes * slots)
    compressed = min(largest_tensor_bytes, plan.max_compress_bytes)
    scratch = max(plan.group_bytes, compressed) * SCRATCH_PER_RAW_BYTE if plan.max_compress_bytes else 0
    return max(0, plan.budget_bytes - arena - (plan.window_bytes or 0) - max(scratch, lone_delta))


def plan_staging(
    requested: str,
    device_bytes: int,
    budget_bytes: int,
    arena_bytes: int,
    slots: int,
    largest_tensor_bytes: int,
    window_bytes: int,
    fence_allowed: bool = True,
) -> StagingPlan:
    """Choose the mode and sizes of one save.

    ``requested``: the ``snapshot`` option (``auto``, ``device``, ``fence``, ``host``);
    ``device_bytes``: the state's bytes on this GPU; ``budget_bytes``: GPU memory this save may
    use; ``arena_bytes``: GPU staging arena already allocated (it stays allocated, so a mode that
    does not use it has that much less); ``slots``: saves that may be in flight; ``largest_tensor_bytes``:
    a tensor over the group size is a group of its own, so its scratch counts in full;
    ``window_bytes``: compressed bytes a ``device`` save may queue on the GPU for the writer;
    ``fence_allowed``: False where nothing would read the live tensors before training moves on
    (``codec="none"``), so a save that cannot copy on the GPU goes to the host instead.

    The plan is for one encoding per tensor; a delta save then applies :func:`with_delta_limit`,
    so a delta never costs a save its mode or its compression.
    """
    if requested == "host":
        return host_plan("snapshot='host' was asked for", budget_bytes - arena_bytes, window_bytes)
    if requested in ("auto", "device"):
        arena = max(arena_bytes, device_bytes * slots)
        # The copy's compressor gets what the arena and the writer's window leave, one group at a
        # time. Small groups only slow compression, which still outruns the disk many times over.
        copy_group = copy_group_bytes_for(budget_bytes - arena - window_bytes)
        copy_scratch = max(copy_group, largest_tensor_bytes) * SCRATCH_PER_RAW_BYTE
        if copy_group >= MIN_GROUP_BYTES and arena + copy_scratch + window_bytes <= budget_bytes:
            why = "the state fits the GPU staging budget" if requested == "auto" else "snapshot='device' was asked for"
            return StagingPlan("device", why, budget_bytes, copy_group, 0, window_bytes,
                               lone_scratch_bytes=budget_bytes - arena - window_bytes)  # fmt: skip
        if device_bytes and arena_bytes >= device_bytes * slots:
            return into_allocated_arena(requested, budget_bytes, arena_bytes, largest_tensor_bytes, window_bytes)
        smallest = max(MIN_GROUP_BYTES, largest_tensor_bytes) * SCRATCH_PER_RAW_BYTE
        why = (
            f"a device copy needs {arena + smallest + window_bytes} bytes of GPU memory but "
            f"gpu_staging_budget_bytes allows {budget_bytes}"
        )
    else:
        why = "snapshot='fence' was asked for"
    # An arena allocated by earlier saves stays allocated: the fence's groups are sized to what it leaves.
    left = budget_bytes - arena_bytes
    group = group_bytes_for(left)
    # In flight: GROUPS_IN_FLIGHT groups' bytes, or one tensor larger than that alone.
    scratch = max(scratch_for(group), largest_tensor_bytes * SCRATCH_PER_RAW_BYTE)
    if not fence_allowed:
        return host_plan(f"{why}; codec='none' reads nothing before training moves on, so not fenced", left,
                         window_bytes)  # fmt: skip
    if scratch > left:
        return host_plan(
            f"{why}; compressing on the GPU needs {scratch} bytes of scratch (groups of {group} bytes, largest "
            f"tensor {largest_tensor_bytes} bytes) and {left} are left",
            left,
            window_bytes,
        )
    if requested != "fence":
        why += ": fenced instead (the next optimizer step waits until the state has been read)"
    # Compressed output kept on the GPU is held until written, by every save in flight.
    return StagingPlan("fence", why, budget_bytes, group, (left - scratch) // max(1, slots), lone_scratch_bytes=scratch)


def into_allocated_arena(
    requested: str, budget_bytes: int, arena_bytes: int, largest_tensor_bytes: int, window_bytes: int
) -> StagingPlan:
    """A ``device`` copy into the arena earlier saves allocated, whatever the budget leaves beside it.

    The arena stays allocated in every mode, so copying into it costs no memory; a fence would
    need the same scratch beside it and hold training, a host copy would pin the whole state.
    The writer's window and the compressor's groups shrink to what is left; tensors whose scratch
    does not fit are stored raw (all of them when not even a group of :data:`MIN_GROUP_BYTES` fits).
    """
    left = max(0, budget_bytes - arena_bytes)
    window = min(window_bytes, left // 2)
    group = copy_group_bytes_for(left - window)
    compress = group >= MIN_GROUP_BYTES
    limit = NO_LIMIT if compress and largest_tensor_bytes <= group else (group if compress else 0)
    why = "snapshot='device' was asked for: copied" if requested == "device" else "copied"
    why += f" into the arena earlier saves allocated, with {left} bytes of the budget left beside it"
    if limit == 0:
        why += " (no room to compress: stored uncompressed)"
    elif limit != NO_LIMIT:
        why += f" (tensors over {limit} bytes stored uncompressed)"
    return StagingPlan("device", why, budget_bytes, max(group, MIN_GROUP_BYTES), 0, window, limit,
                       lone_scratch_bytes=(left - window) if compress else 0)  # fmt: skip


def host_plan(why: str, budget_bytes: int, window_bytes: int) -> StagingPlan:
    """A raw copy to pinned host memory, compressed on the GPU within ``budget_bytes``: half for the
    scratch of one group at a time, half for compressed bytes waiting for the writer; tensors too
    large for that scratch are stored raw."""
    share = max(0, budget_bytes) // 2
    largest = share // SCRATCH_PER_RAW_BYTE
    reason = why if why.startswith("snapshot=") else f"{why}: staged raw in pinned host memory instead"
    return StagingPlan("host", reason, budget_bytes, max(1, min(largest, MAX_GROUP_BYTES)), 0,
                       min(window_bytes, share), largest, lone_scratch_bytes=share)  # fmt: skip


def fenced_instead(plan: StagingPlan, why: str, fence_allowed: bool = True, forms: int = 1) -> StagingPlan:
    """``plan`` run as a ``fence`` with every compressed group sent to the host (a device copy failed: ``why``)."""
    if not fence_allowed:
        return host_plan(f"{why}; codec='none' cannot be fenced", plan.budget_bytes, plan.window_bytes or 0)
    # The device plan's (smaller) groups, split between the fence's groups in flight: the arena just
    # failed to allocate, so the GPU has less memory than the budget assumed, and small groups are
    # what is likely to fit.
    group = max(MIN_GROUP_BYTES, plan.group_bytes // GROUPS_IN_FLIGHT)
    # Delta forms of a lone tensor get no more than the groups' own scratch, what the copy counted.
    limit = scratch_for(group) // (SCRATCH_PER_RAW_BYTE * forms) if forms > 1 else NO_LIMIT
    return StagingPlan("fence", f"{why}: fenced instead", plan.budget_bytes, group, 0,
                       max_delta_bytes=min(plan.max_delta_bytes, limit))  # fmt: skip
