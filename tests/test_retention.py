"""keep_last retention and the latest pointer."""

from __future__ import annotations

from pathlib import Path

import torch

import asyncckpt
from asyncckpt.layout import LATEST_NAME


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
