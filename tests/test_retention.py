"""keep_last retention and the latest pointer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt._layout import LATEST_NAME


def test_keep_last_deletes_oldest_only(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir, keep_last=2, max_inflight=2) as ckpt:
        for step in range(1, 6):
            ckpt.save(step * 10, {"step": torch.tensor(step)})
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [40, 50]
    assert (run_dir / LATEST_NAME).read_text().strip() == "step-0000000050"
    assert int(asyncckpt.load(run_dir)["step"]) == 5
    assert sorted(p.name for p in run_dir.iterdir()) == [LATEST_NAME, "step-0000000040", "step-0000000050"]


def test_retention_never_deletes_the_newest_even_if_saved_out_of_order(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir, keep_last=1) as ckpt:
        ckpt.save(500, {"a": torch.ones(1)}).result()
        ckpt.save(100, {"a": torch.zeros(1)}).result()  # e.g. a restarted run re-saving an earlier step
    steps = [c.step for c in asyncckpt.list_checkpoints(run_dir)]
    assert steps == [100, 500], "keeps the one just written and the newest step"
    assert asyncckpt.latest_step(run_dir) == 100  # latest = the most recently committed


def test_missing_or_bad_latest_pointer_falls_back_to_highest_step(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        ckpt.save(1, {"a": torch.ones(1)})
        ckpt.save(2, {"a": torch.ones(1) * 2})
    (run_dir / LATEST_NAME).write_text("../../elsewhere\n")
    assert asyncckpt.latest_step(run_dir) == 2
    (run_dir / LATEST_NAME).unlink()
    assert asyncckpt.latest_step(run_dir) == 2
    assert asyncckpt.latest_step(run_dir / "nowhere") is None
    assert asyncckpt.list_checkpoints(run_dir / "nowhere") == []


def test_a_restart_from_an_earlier_step_keeps_the_new_timeline_and_leaves_the_abandoned_one(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir, keep_last=2) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, {"w": torch.tensor(step)}).result()
    # The job restarts from step 10 and goes on: 11, 12, 13.
    with asyncckpt.AsyncCheckpointer(run_dir, keep_last=2) as ckpt:
        for step in (11, 12, 13):
            ckpt.save(step, {"w": torch.tensor(step)}).result()
            assert asyncckpt.latest_step(run_dir) == step
        # Retention counted only the new timeline (steps up to 13): its newest two stay.
        assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [12, 13, 20, 30]
        with pytest.raises(asyncckpt.CheckpointError, match=r"after the latest one \(step 13\).*discard_steps_after"):
            ckpt.save(20, {"w": torch.tensor(20)})
        assert ckpt.discard_steps_after(13) == [20, 30]
        ckpt.save(20, {"w": torch.tensor(-20)}).result()
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [13, 20]
    assert int(asyncckpt.load(run_dir)["w"]) == -20


def test_retention_never_follows_or_deletes_a_symlinked_step(run_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    with asyncckpt.AsyncCheckpointer(elsewhere) as ckpt:
        target = ckpt.save(2, {"w": torch.ones(1)}).result().path
    assert target is not None
    run_dir.mkdir()
    (run_dir / "step-0000000002").symlink_to(target, target_is_directory=True)
    with asyncckpt.AsyncCheckpointer(run_dir, keep_last=1) as ckpt:
        with pytest.raises(asyncckpt.CheckpointError, match="exists but is not a checkpoint"):
            ckpt.save(2, {"w": torch.zeros(1)})
        for step in (1, 3, 4):
            ckpt.save(step, {"w": torch.zeros(1)}).result()
        assert ckpt.discard_steps_after(0) == [4]  # retention left step 4 only; the symlink is no checkpoint
    assert (run_dir / "step-0000000002").is_symlink() and (target / "manifest.json").is_file()
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == []
    assert [c.step for c in asyncckpt.list_checkpoints(elsewhere)] == [2]
