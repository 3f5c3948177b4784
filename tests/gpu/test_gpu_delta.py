"""Incremental checkpoints on the GPU path: every snapshot mode stores deltas against the chain's
full save (or the save before), each step restores bit for bit (on the GPU and on the host), and
the chain policy holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpu_env import Trainer, requires_gpu

import asyncckpt
from asyncckpt import SaveResult
from asyncckpt._manifest import read_manifest
from asyncckpt.testing.state_compare import clone_state, first_difference

pytestmark = requires_gpu


@pytest.mark.parametrize(("snapshot", "codec", "policy"), [
    ("device", "auto", "full"), ("fence", "auto", "full"), ("host", "auto", "full"), ("device", "ans", "full"),
    ("fence", "auto", "previous"), ("device", "auto", "previous")])  # fmt: skip
def test_a_delta_chain_restores_every_step_bit_for_bit(run_dir: Path, snapshot: str, codec: str,
                                                       policy: str) -> None:  # fmt: skip
    trainer = Trainer(width=512, layers=3, autocast=True, fused=True)
    trainer.step()
    saved = []
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot=snapshot, codec=codec, delta="on", delta_full_every=3,
                                     delta_reference=policy) as ckpt:  # fmt: skip
        for step in range(1, 8):
            for _ in range(2):
                trainer.step()
            state = trainer.state(grads=False)
            reference = clone_state(state)
            handle = ckpt.save(step, state)
            trainer.optimizer.step()  # in place, right behind the save: the fence (or the copy) must hold it
            saved.append((reference, handle.result(timeout=300)))
            # Reference memory is allocated in the background after each commit; waiting for it makes
            # the chain's shape below exact (a save that comes sooner stores the keys not yet ready in full).
            assert ckpt._delta is not None and ckpt._delta.store.wait_prepared(60)  # type: ignore[attr-defined]
    kinds = {}
    for reference, result in saved:
        for where in (None, "cpu"):
            restored = asyncckpt.load(run_dir, step=result.step, map_location=where)
            assert first_difference(reference, restored) is None, f"step {result.step} on {where or 'its device'}"
        asyncckpt.verify(run_dir, step=result.step)
        manifest = read_manifest(result.path)
        kinds[result.step] = ({t.delta for t in manifest.tensors} - {None}, manifest.reference)
    # Save 1 keeps no references (their memory is allocated after it), so the chain starts at save 2,
    # and every third save of it is full.
    for step in (1, 2, 5):
        assert kinds[step] == (set(), None), kinds
    base_of = {3: 2, 4: 2, 6: 5, 7: 5} if policy == "full" else {3: 2, 4: 3, 6: 5, 7: 6}
    for step, base_step in base_of.items():
        ops, base = kinds[step]
        assert ops and base is not None and base.step == base_step, kinds


def save_steps(ckpt: asyncckpt.AsyncCheckpointer, trainer: Trainer, steps: tuple[int, ...],
               wait_for_references: bool = False) -> list[tuple[dict[str, Any], SaveResult]]:  # fmt: skip
    """One training step before each save and an in-place optimizer step right behind it (the fence
    must hold it); (the state as saved, its result) per step. ``wait_for_references``: after each
    save, until its reference memory is allocated, which makes the chain's shape exact."""
    saved = []
    for step in steps:
        trainer.step()
        state = trainer.state(grads=False)
        reference = clone_state(state)
        handle = ckpt.save(step, state)
        trainer.optimizer.step()
        saved.append((reference, handle.result(timeout=300)))
        if wait_for_references:
            assert ckpt._delta is not None and ckpt._delta.store.wait_prepared(60)  # type: ignore[attr-defined]
    return saved


def test_preallocate_lets_the_first_save_keep_its_references(run_dir: Path) -> None:
    """With the reference memory allocated ahead (``preallocate``), save 1 keeps its references and
    save 2 is already a delta against it; both restore bit for bit."""
    trainer = Trainer(width=512, layers=2, autocast=True, fused=True)
    trainer.step()
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="fence", delta="on", delta_full_every=4) as ckpt:
        ckpt.preallocate(trainer.state(grads=False)).join(120)
        saved = save_steps(ckpt, trainer, (1, 2))
    for reference, result in saved:
        assert first_difference(reference, asyncckpt.load(run_dir, step=result.step)) is None, result.step
    second = read_manifest(saved[1][1].path)
    assert second.reference is not None and second.reference.step == 1
    assert {t.delta for t in second.tensors} - {None}, "save 2 is a delta: its references were kept by save 1"


def test_a_tight_budget_keeps_the_fence_and_drops_only_the_large_deltas(run_dir: Path) -> None:
    """A GPU staging budget of 12x the largest tensor: the fence still runs, compressed (with room
    for one encoding of each tensor); delta forms get what is left for a tensor alone, 1/24 of the
    budget, so the 48-64 MiB tensors are stored in full and the 16 MiB ones as deltas, the save says
    so, and every step restores bit for bit."""
    trainer = Trainer(width=2048, layers=1, autocast=True, fused=True)
    trainer.step()
    largest = max(t.nbytes for t in trainer.model.state_dict().values())
    budget = 12 * largest
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="fence", delta="on", delta_full_every=4,
                                     gpu_staging_budget_bytes=budget) as ckpt:  # fmt: skip
        saved = save_steps(ckpt, trainer, (1, 2, 3), wait_for_references=True)
        notes = list(ckpt._backend.encoder.history[-1].notes)  # type: ignore[union-attr]
        store = ckpt._delta.store  # type: ignore[union-attr]
        held = store.device_bytes + store.host_bytes  # type: ignore[attr-defined]
    for reference, result in saved:
        assert result.snapshot_mode == "fence" and result.ratio > 1.05, result
        assert first_difference(reference, asyncckpt.load(run_dir, step=result.step)) is None, result.step
    limit = budget // 24
    third = read_manifest(saved[2][1].path)
    assert third.reference is not None and third.reference.step == 2
    large = [t for t in third.tensors if t.raw_bytes > limit]
    small = [t for t in third.tensors if 1 << 20 <= t.raw_bytes <= limit]
    assert large and all(t.delta is None for t in large), [(t.key, t.raw_bytes, t.delta) for t in large]
    assert small and any(t.delta is not None for t in small), [(t.key, t.raw_bytes, t.delta) for t in small]
    assert any("stored without a delta" in note for note in notes), notes
    # No reference memory is held for tensors that cannot be deltas at this budget.
    assert held <= sum(t.raw_bytes for t in third.tensors if t.raw_bytes <= limit), (held, limit)
    assert any("stored without a delta" in note for note in saved[2][1].notes), saved[2][1]  # the SaveResult says so
    assert not saved[0][1].notes, saved[0][1]  # a full save had no delta to give up


@pytest.mark.parametrize("snapshot", ["fence", "device"])
def test_auto_takes_no_delta_in_a_fence_save_and_deltas_in_a_copy(run_dir: Path, snapshot: str) -> None:
    """``delta="auto"``: a fence save, whose references could only cross PCIe while the fence holds
    training, takes no delta and keeps no reference memory, and says why; a device copy's chain takes
    deltas. Every step restores bit for bit."""
    trainer = Trainer(width=2048, layers=1, autocast=True, fused=True)
    trainer.step()
    largest = max(t.nbytes for t in trainer.model.state_dict().values())
    budget = 12 * largest if snapshot == "fence" else 17 << 30
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot=snapshot, delta="auto", delta_full_every=4,
                                     gpu_staging_budget_bytes=budget) as ckpt:  # fmt: skip
        ckpt.preallocate(trainer.state(grads=False)).join(120)
        saved = save_steps(ckpt, trainer, (1, 2, 3), wait_for_references=True)
        store: Any = ckpt._delta.store  # type: ignore[union-attr]
        held = store.device_bytes + store.host_bytes
    for reference, result in saved:
        assert result.snapshot_mode == snapshot and result.ratio > 1.05, result
        assert first_difference(reference, asyncckpt.load(run_dir, step=result.step)) is None, result.step
    deltas = [t.delta for _reference, result in saved for t in read_manifest(result.path).tensors if t.delta]
    if snapshot == "fence":
        assert all("delta='auto' takes no delta in a fence save" in r.snapshot_reason for _s, r in saved), saved
        assert not deltas and held == 0, (deltas, held)
    else:
        assert deltas, "a copy's chain takes deltas"


def test_references_take_only_the_room_the_budget_leaves_and_give_it_up_when_it_shrinks(run_dir: Path) -> None:
    """One GPU budget for staging and references. Of a 17 GiB budget, a device copy of this small
    state takes its arena, the writer's 1 GiB window and 8 GiB of scratch (1 GiB groups), and the
    references may take the rest, on the GPU. When the budget then shrinks to the arena, the window,
    24x the largest tensor and half of what the references hold, keeping them would leave the
    largest tensors no scratch for their delta forms: the next save gives them up instead (same
    mode, a delta of every tensor), they come back in host memory, and every step restores bit for bit."""
    trainer = Trainer(width=1024, layers=2, autocast=True, fused=True)
    trainer.step()
    largest = max(t.nbytes for t in trainer.model.state_dict().values())
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="device", delta="on", delta_full_every=10,
                                     gpu_staging_budget_bytes=17 << 30) as ckpt:  # fmt: skip
        store: Any = ckpt._delta.store  # type: ignore[union-attr]
        stager: Any = ckpt._backend.stager  # type: ignore[attr-defined]
        saved = save_steps(ckpt, trainer, (1, 2, 3), wait_for_references=True)
        on_gpu = store.device_bytes
        assert on_gpu > 0 and store.host_bytes == 0, (on_gpu, store.host_bytes)
        assert stager.arena.allocated_bytes + (1 << 30) + (8 << 30) + on_gpu <= 17 << 30
        stager.gpu_budget_bytes = stager.arena.allocated_bytes + stager.window_bytes + 24 * largest + on_gpu // 2
        saved += save_steps(ckpt, trainer, (4, 5, 6, 7), wait_for_references=True)
        assert store.device_bytes == 0 and store.host_bytes >= on_gpu, (store.device_bytes, store.host_bytes)
    for reference, result in saved:
        assert result.snapshot_mode == "device" and result.ratio > 1.05, result
        assert first_difference(reference, asyncckpt.load(run_dir, step=result.step)) is None, result.step
    manifests = {result.step: read_manifest(result.path) for _, result in saved}
    assert manifests[3].reference is not None and any(t.delta for t in manifests[3].tensors), "GPU references"
    assert manifests[7].reference is not None and any(t.delta for t in manifests[7].tensors), "host references"
    assert not any("stored without a delta" in note for _, result in saved for note in result.notes)
