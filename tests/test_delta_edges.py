"""Incremental checkpoints at the edges an outside review found: every save that reports success
loads, whatever changes between saves or happens to the directory (a key's dtype, colliding key
paths, a restart below an abandoned timeline, another checkpointer deleting the base), and a
restore at the end of a long chain holds two raw buffers per tensor, not one per level."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

import asyncckpt
import asyncckpt._delta_chain as delta_chain
from asyncckpt._layout import list_checkpoints
from asyncckpt._manifest import read_manifest
from asyncckpt.errors import CheckpointError, SaveFailedError


def _noise(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _loads_bit_exact(run: Path, step: int, expected: dict) -> None:
    restored = asyncckpt.load(run, step=step)
    for key, value in expected.items():
        assert torch.equal(restored[key].view(torch.uint8), value.view(torch.uint8)), (step, key)


def test_a_key_whose_dtype_changed_is_stored_in_full(tmp_path: Path) -> None:
    w = torch.arange(4096, dtype=torch.float32)
    with asyncckpt.AsyncCheckpointer(tmp_path, delta="on") as ckpt:
        ckpt.save(1, {"w": w}).result()
        retyped = w.view(torch.int32).clone()  # the same bytes, another dtype
        ckpt.save(2, {"w": retyped}).result()
    _loads_bit_exact(tmp_path, 2, {"w": retyped})
    assert read_manifest(tmp_path / "step-0000000002").reference is None


def test_colliding_key_paths_are_stored_in_full(tmp_path: Path) -> None:
    first, second = torch.arange(4096.0), torch.arange(4096.0) * 2
    with asyncckpt.AsyncCheckpointer(tmp_path, delta="on") as ckpt:
        ckpt.save(1, {"a/b": first, "a": {"b": second}}).result()
        first[:10] += 1
        second[:10] += 1
        ckpt.save(2, {"a/b": first, "a": {"b": second}, "other": torch.zeros(4096)}).result()
    restored = asyncckpt.load(tmp_path, step=2)
    assert torch.equal(restored["a/b"], first) and torch.equal(restored["a"]["b"], second)
    assert {t.delta for t in read_manifest(tmp_path / "step-0000000002").tensors if t.key == "a/b"} == {None}


def test_retention_after_a_restart_keeps_the_bases_of_the_abandoned_timeline(tmp_path: Path) -> None:
    w = torch.arange(8192.0)
    saved = {}
    with asyncckpt.AsyncCheckpointer(tmp_path, delta="on", delta_full_every=4) as ckpt:
        for step in (10, 20, 30):
            w[:5] += 1
            ckpt.save(step, {"w": w}).result()
            saved[step] = w.clone()
    assert read_manifest(tmp_path / "step-0000000030").reference is not None
    with asyncckpt.AsyncCheckpointer(tmp_path, delta="on", keep_last=1) as ckpt:  # resumed from step 20
        w[:5] += 1
        ckpt.save(25, {"w": w}).result()
        saved[25] = w.clone()
    steps = [c.step for c in list_checkpoints(tmp_path)]
    assert 25 in steps and 30 in steps
    for step in steps:
        _loads_bit_exact(tmp_path, step, {"w": saved[step]})


def test_a_base_deleted_elsewhere_fails_the_save_and_the_next_is_full(tmp_path: Path) -> None:
    w = _noise(8192)
    ours = asyncckpt.AsyncCheckpointer(tmp_path, delta="on")
    try:
        ours.save(1, {"w": w}).result()
        with asyncckpt.AsyncCheckpointer(tmp_path, keep_last=1) as other:
            other.save(2, {"w": w}).result()  # its retention deletes step 1, our base
        w[:5] += 1
        with pytest.raises(SaveFailedError, match="no longer the one it was encoded against"):
            ours.save(3, {"w": w}).result()
        assert not (tmp_path / "step-0000000003").exists()
        w[:5] += 1
        # The contract: a background failure not yet raised by save() is raised once by the next save().
        with pytest.raises(SaveFailedError, match="no longer the one it was encoded against"):
            ours.save(4, {"w": w})
        ours.save(4, {"w": w}).result()
    finally:
        ours.close()
    assert read_manifest(tmp_path / "step-0000000004").reference is None
    _loads_bit_exact(tmp_path, 4, {"w": w})


def test_restoring_a_long_chain_holds_two_raw_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    depth = 8
    w = _noise(1 << 16)
    with asyncckpt.AsyncCheckpointer(tmp_path, delta="on", delta_full_every=depth) as ckpt:
        for step in range(1, depth + 1):
            w[:5] += 1
            ckpt.save(step, {"w": w}).result()
    assert read_manifest(tmp_path / f"step-{depth:010d}").reference is not None
    live: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
    peak = [0]
    original = delta_chain.read_record_raw

    def counting(*args: object) -> torch.Tensor:
        out = original(*args)  # type: ignore[arg-type]
        live.add(out)
        peak[0] = max(peak[0], len(live))
        return out

    monkeypatch.setattr(delta_chain, "read_record_raw", counting)
    _loads_bit_exact(tmp_path, depth, {"w": w})
    assert peak[0] <= 2, f"{peak[0]} raw buffers alive at once for a chain of {depth}"


def test_the_framework_integrations_refuse_delta(tmp_path: Path) -> None:
    from asyncckpt.integrations._targeted import TargetedCheckpointer

    with pytest.raises(CheckpointError, match="always write full checkpoints"):
        TargetedCheckpointer(tmp_path, delta="on")
