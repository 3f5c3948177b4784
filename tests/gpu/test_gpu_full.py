"""Saving on a GPU with little memory to spare: every save stays within its GPU budget, degrades
(compressed bytes to pinned host memory, a fence instead of a copy, raw host staging) instead of
running out of memory, says why in ``SaveResult``, and restores bit for bit."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_env import Trainer, requires_gpu

import asyncckpt
from asyncckpt._gpu.budget import MIN_GROUP_BYTES, scratch_for
from asyncckpt.result import SaveResult
from asyncckpt.testing.state_compare import clone_state, first_difference

pytestmark = requires_gpu


@pytest.fixture(autouse=True)
def _give_cached_memory_back() -> Iterator[None]:
    """These tests fill the GPU; later tests must see its memory free again, not cached by PyTorch."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


MiB = 1 << 20
SMALLEST_SCRATCH = scratch_for(MIN_GROUP_BYTES)


def save_while_training(
    ckpt: asyncckpt.AsyncCheckpointer, trainer: Trainer, steps: range, grads: bool = True
) -> list[tuple[Any, SaveResult]]:
    """Save at every step with optimizer steps right behind each save; (reference, result) pairs."""
    out = []
    for step in steps:
        trainer.backward()
        state = trainer.state(grads=grads)
        reference = clone_state(state)
        handle = ckpt.save(step, state)
        trainer.optimizer.step()  # must wait for the fence: the bytes on disk are the ones at save()
        trainer.optimizer.step()
        out.append((reference, handle.result(timeout=300)))
    return out


def assert_restores(run_dir: Path, pairs: list[tuple[Any, SaveResult]]) -> None:
    for reference, result in pairs:
        restored = asyncckpt.load(run_dir, step=result.step)
        assert first_difference(reference, restored) is None, f"step {result.step}"


def test_fence_over_the_budget_spills_compressed_groups_to_pinned_memory(run_dir: Path) -> None:
    trainer = Trainer(width=512, layers=4, autocast=True, fused=True)
    trainer.step()  # every save holds the same tensors (AdamW's moments exist from the first step)
    budget = SMALLEST_SCRATCH + 8 * MiB  # room for the scratch, almost none for compressed output
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="fence", gpu_staging_budget_bytes=budget) as ckpt:
        pairs = save_while_training(ckpt, trainer, range(1, 4))
        stats = list(ckpt._backend.encoder.history)[-3:]
        pinned = ckpt._backend.stager.pool.allocated_bytes
        blocks = len(ckpt._backend.stager.pool._free)
    for _reference, result in pairs:
        assert result.snapshot_mode == "fence"
    assert all(s.spilled_bytes > 0 for s in stats)
    stored = max(result.stored_bytes for _reference, result in pairs)
    # Blocks are whole 2 MiB pages: at this small size (16 MiB groups) that rounding is the slack.
    assert pinned <= 1.1 * stored + blocks * 2 * MiB, f"pinned staging {pinned} for {stored} compressed bytes"
    assert_restores(run_dir, pairs)


def test_device_over_the_budget_runs_fenced_and_says_why(run_dir: Path) -> None:
    trainer = Trainer(width=512, layers=4, autocast=True, fused=True)
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="device", gpu_staging_budget_bytes=SMALLEST_SCRATCH) as ckpt:
        pairs = save_while_training(ckpt, trainer, range(1, 3))
    for _reference, result in pairs:
        assert result.snapshot_mode == "fence"
        assert "fenced instead" in result.snapshot_reason
    assert_restores(run_dir, pairs)


def test_a_budget_below_the_scratch_stages_raw_in_host_memory(run_dir: Path) -> None:
    trainer = Trainer(width=256, layers=2, autocast=True)
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="fence", gpu_staging_budget_bytes=16 * MiB) as ckpt:
        pairs = save_while_training(ckpt, trainer, range(1, 3))
    for _reference, result in pairs:
        assert result.snapshot_mode == "host"
        assert "scratch" in result.snapshot_reason
    assert_restores(run_dir, pairs)


def test_a_spent_host_budget_paces_the_rest_by_the_disk(run_dir: Path) -> None:
    trainer = Trainer(width=512, layers=4, autocast=True, fused=True)  # fused: no CPU tensors to stage
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="fence", gpu_staging_budget_bytes=SMALLEST_SCRATCH,
                                     host_staging_budget_bytes=4 * MiB) as ckpt:  # fmt: skip
        pairs = save_while_training(ckpt, trainer, range(1, 3))
        notes = [n for s in ckpt._backend.encoder.history for n in s.notes]
    assert any("host_staging_budget_bytes" in n for n in notes)
    # The SaveResult carries the same notes (issue 15: a save that degrades says so in its result).
    assert any("host_staging_budget_bytes" in n for _reference, result in pairs for n in result.notes), pairs
    assert_restores(run_dir, pairs)


def test_preallocate_pins_before_the_first_save(run_dir: Path) -> None:
    trainer = Trainer(width=512, layers=4, autocast=True, fused=True)
    trainer.step()  # AdamW's moments exist from the first step
    state = trainer.state(grads=True)
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="fence", gpu_staging_budget_bytes=SMALLEST_SCRATCH) as ckpt:
        thread = ckpt.preallocate(state)
        assert isinstance(thread, threading.Thread)
        thread.join()
        pool = ckpt._backend.stager.pool
        pinned = pool.pinned_bytes_total
        assert pool.allocated_bytes == pinned > 0
        pairs = save_while_training(ckpt, trainer, range(1, 3))
        # The reservation follows the compressor's grouping; a group that compresses worse than its
        # raw size plus headroom (rare: ANS on incompressible bytes) may still pin a block.
        assert pool.pinned_bytes_total <= 1.1 * pinned, "the saves pinned (almost) nothing new"
        assert 0 < pool.allocated_bytes <= pinned  # what the first save left unused was given back
    assert_restores(run_dir, pairs)


def test_a_nearly_full_gpu_saves_within_its_default_budget(run_dir: Path) -> None:
    """Fill the GPU until 3 GB are free, then save a 1.2 GB state (weights and AdamW moments) with
    the defaults (``auto``): the driver-reported memory in use never grows past the budget (a
    quarter of what is free). Gradients are left out: a save holds the ones it was given while
    the next backward makes new ones, which is training's memory, not the checkpointer's."""
    trainer = Trainer(width=1024, layers=8, autocast=True, fused=True)
    for _ in range(2):
        trainer.step()
    device = trainer.device
    free, _total = torch.cuda.mem_get_info(device)
    filler = torch.empty(free - 3_000_000_000, dtype=torch.uint8, device=device)
    trainer.step()
    free_before = torch.cuda.mem_get_info(device)[0]
    budget = free_before // 4
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        torch.cuda.set_device(device)
        while not stop.wait(0.005):
            free_now, _total = torch.cuda.mem_get_info(device)
            peak[0] = max(peak[0], free_before - free_now)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
            # The first save loads nvCOMP's and the copy kernels' modules onto the device (lazy
            # CUDA module loading): a one-time cost of using the GPU path, not staging memory.
            pairs = save_while_training(ckpt, trainer, range(1, 2), grads=False)
            free_before = torch.cuda.mem_get_info(device)[0]
            sampler.start()
            pairs += save_while_training(ckpt, trainer, range(2, 5), grads=False)
            spilled = [s.spilled_bytes for s in ckpt._backend.encoder.history]
    finally:
        stop.set()
        if sampler.is_alive():
            sampler.join()
        del filler
    for _reference, result in pairs:
        assert result.snapshot_mode == "fence", result.snapshot_reason
    # The sampler sees what the driver sees; the training steps' own transient memory is cached
    # by PyTorch already, so growth is the checkpointer's.
    assert peak[0] <= budget + 64 * MiB, f"peak extra GPU memory {peak[0]} over the budget {budget}"
    assert all(n > 0 for n in spilled), "the state did not fit the budget: compressed bytes went to the host"
    assert_restores(run_dir, pairs)


def test_an_optimistic_budget_on_a_full_gpu_degrades_instead_of_failing(run_dir: Path) -> None:
    """A budget far above what is free (the plan is an estimate; training's use moves): the device
    arena fails to allocate and the save runs fenced; the compressor runs out of memory, retries
    in smaller groups, and stores what still does not fit raw. Every save succeeds, bit for bit.
    No training runs while the GPU is full (it would need the memory itself)."""
    trainer = Trainer(width=1024, layers=4, autocast=True, fused=True)
    trainer.step()
    trainer.backward()
    state = trainer.state()
    reference = clone_state(state)
    torch.cuda.empty_cache()  # the fill below takes PyTorch's cached blocks too
    free, _total = torch.cuda.mem_get_info(trainer.device)
    filler = torch.empty(free - 64 * MiB, dtype=torch.uint8, device=trainer.device)
    try:
        with asyncckpt.AsyncCheckpointer(run_dir, snapshot="device", gpu_staging_budget_bytes=40 << 30) as ckpt:
            handle = ckpt.save(1, state)
            trainer.optimizer.step()  # fused AdamW, in place: waits for the fence
            result = handle.result(timeout=300)
            notes = [n for s in ckpt._backend.encoder.history for n in s.notes]
    finally:
        del filler
        torch.cuda.empty_cache()
    assert result.snapshot_mode == "fence"
    assert "could not be allocated" in result.snapshot_reason
    assert any("ran short" in n or "raw" in n for n in notes), notes
    assert_restores(run_dir, [(reference, result)])
