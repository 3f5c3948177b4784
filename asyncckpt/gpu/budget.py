"""How a GPU save fits in memory: the snapshot mode, the compressor's group size, the scratch it may hold.

Pure arithmetic over sizes in bytes, decided on the training thread inside ``save()`` from what
it measures then (free GPU memory, the state's size, the host budget) and recorded with the
snapshot, so a :class:`~asyncckpt.result.SaveResult` says which mode ran and why.

The compressor never holds more GPU memory than ``scratch_bytes``: it compresses the state in
groups of ``group_bytes`` of consecutive tensors, two groups in flight (one encoding while the
previous one is resolved), each costing at most :data:`SCRATCH_PER_RAW_BYTE` times its raw size
(nvCOMP's outputs for every ``auto`` candidate, a byte-plane copy, the packed result, an upload
buffer, allocator slack). Compressed groups stay on the GPU while they fit ``resident_bytes``; the rest goes to
pinned host memory (:mod:`asyncckpt.gpu.pinned_pool`), bounded by the host staging budget.

Modes:

``device``
    The whole state copied into an arena at ``save()``. Only when the arena plus the
    compressor's scratch fits the budget; otherwise the save runs as ``fence`` and says so.
``fence``
    Nothing copied; the next ``optimizer.step()`` waits until the compressor has read every
    tensor. Works at any state size: memory is the scratch, plus compressed bytes kept on the GPU
    up to ``resident_bytes``, plus pinned host memory for the rest.
``host``
    A raw copy into pinned host memory, only when asked for explicitly (``auto`` prefers to
    compress on the GPU first: host memory and PCIe then carry the compressed bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SCRATCH_PER_RAW_BYTE = 8
"""GPU scratch per raw byte of a group in flight: up to three ``auto`` candidates' outputs (each
bounded a little above the raw size), a byte-plane copy, the packed result, an upload buffer for
host-staged tensors, and slack for PyTorch's caching allocator, which keeps freed blocks."""
GROUPS_IN_FLIGHT = 2
MIN_GROUP_BYTES = 16 << 20
"""Below this, per-call overheads dominate (~0.6 ms host time per nvCOMP call)."""
MAX_GROUP_BYTES = 1 << 30
FREE_FRACTION = 4
"""The default GPU budget is free memory divided by this, re-read at every save."""


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


def scratch_for(group_bytes: int) -> int:
    return group_bytes * SCRATCH_PER_RAW_BYTE * GROUPS_IN_FLIGHT


def default_gpu_budget(free_bytes: int) -> int:
    return free_bytes // FREE_FRACTION


def plan_staging(
    requested: str,
    device_bytes: int,
    budget_bytes: int,
    arena_bytes: int,
    slots: int,
    largest_tensor_bytes: int,
    window_bytes: int,
) -> StagingPlan:
    """Choose the mode and sizes of one save.

    ``requested``: the ``snapshot`` option (``auto``, ``device``, ``fence``, ``host``);
    ``device_bytes``: the state's bytes on this GPU; ``budget_bytes``: GPU memory this save may
    use; ``arena_bytes``: GPU staging arena already allocated (reused, so it counts as in the
    budget); ``slots``: saves that may be in flight; ``largest_tensor_bytes``: a tensor over the
    group size is a group of its own, so its scratch counts in full.
    """
    if requested == "host":
        return StagingPlan("host", "snapshot='host' was asked for", budget_bytes, group_bytes_for(budget_bytes), 0)
    group = group_bytes_for(budget_bytes)
    # In flight: GROUPS_IN_FLIGHT groups' bytes, or one tensor larger than that alone.
    scratch = max(scratch_for(group), largest_tensor_bytes * SCRATCH_PER_RAW_BYTE)
    if requested in ("auto", "device"):
        arena = max(arena_bytes, device_bytes * slots)
        if arena + scratch + window_bytes <= budget_bytes:
            why = "the state fits the GPU staging budget" if requested == "auto" else "snapshot='device' was asked for"
            return StagingPlan("device", why, budget_bytes, group, 0)
        why = (
            f"a device copy needs {arena + scratch + window_bytes} bytes of GPU memory but "
            f"gpu_staging_budget_bytes allows {budget_bytes}: fenced instead (the next optimizer step waits "
            "until the state has been read)"
        )
    else:
        why = "snapshot='fence' was asked for"
    if scratch > budget_bytes:
        return StagingPlan(
            "host",
            f"compressing on the GPU needs {scratch} bytes of scratch (groups of {group} bytes, largest tensor "
            f"{largest_tensor_bytes} bytes) but gpu_staging_budget_bytes allows {budget_bytes}: staged raw in pinned "
            "host memory instead",
            budget_bytes,
            group,
            0,
        )
    return StagingPlan("fence", why, budget_bytes, group, budget_bytes - scratch)


def fenced_instead(plan: StagingPlan, why: str) -> StagingPlan:
    """``plan`` run as a ``fence`` with every compressed group sent to the host (a device copy failed: ``why``)."""
    return StagingPlan("fence", f"{why}: fenced instead", plan.budget_bytes, plan.group_bytes, 0)
