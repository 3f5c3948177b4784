"""Which checkpoint load(dir) reads: never an older state in place of the one ``latest`` names,
never a step directory that is a symlink (it may point outside the run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt._layout import LATEST_NAME
from asyncckpt._manifest import MANIFEST_NAME


@pytest.fixture
def run(run_dir: Path) -> Path:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        for step in (100, 200):
            ckpt.save(step, {"w": torch.full((4,), float(step))}).result()
    assert (run_dir / LATEST_NAME).read_text().strip() == "step-0000000200"
    return run_dir


def _both(run: Path, message: str, error: type[Exception] = asyncckpt.CheckpointError) -> None:
    for check in (asyncckpt.load, asyncckpt.verify):
        with pytest.raises(error, match=message):
            check(run)


def test_latest_naming_a_checkpoint_whose_manifest_is_gone_raises_naming_both_steps(run: Path) -> None:
    (run / "step-0000000200" / MANIFEST_NAME).unlink()
    _both(run, r"latest names step 200, but .*step-0000000200 has no manifest\.json; not falling back .*"
               r"newest committed step is 100: load\(\.\.\., step=100\)")  # fmt: skip
    assert torch.equal(asyncckpt.load(run, step=100)["w"], torch.full((4,), 100.0))


def test_latest_naming_a_missing_directory_raises(run: Path) -> None:
    shutil.rmtree(run / "step-0000000200")
    _both(run, r"latest names step 200, but .*step-0000000200 is missing.*step is 100")


def test_latest_naming_a_corrupt_checkpoint_raises_naming_the_older_one(run: Path) -> None:
    data = run / "step-0000000200" / "data-0.bin"
    data.write_bytes(bytes(data.stat().st_size))  # every blob zeroed: checksums fail
    _both(run, r"step-0000000200.*checksum mismatch.*latest names this checkpoint; not falling back.*step=100",
          asyncckpt.CorruptCheckpointError)  # fmt: skip
    manifest = run / "step-0000000200" / MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes()[:-2])
    _both(run, r"manifest digest mismatch.*not falling back.*step=100", asyncckpt.CorruptCheckpointError)


def test_a_missing_pointer_still_falls_back_to_the_highest_step(run: Path) -> None:
    # A commit whose pointer update failed removes the pointer on purpose (docs/format.md).
    (run / LATEST_NAME).unlink()
    assert torch.equal(asyncckpt.load(run)["w"], torch.full((4,), 200.0))


def test_a_step_directory_that_is_a_symlink_outside_the_run_is_not_read(run: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    shutil.copytree(run / "step-0000000100", outside)
    shutil.rmtree(run / "step-0000000100")
    (run / "step-0000000100").symlink_to(outside, target_is_directory=True)
    for check in (lambda: asyncckpt.load(run, step=100), lambda: asyncckpt.verify(run, step=100)):
        with pytest.raises(asyncckpt.CheckpointError, match=r"step-0000000100 is a symlink \(step=100\)"):
            check()
    (run / LATEST_NAME).write_text("step-0000000100\n")
    _both(run, r"step-0000000100 is a symlink \(latest names it\)")
    assert torch.equal(asyncckpt.load(outside)["w"], torch.full((4,), 100.0))  # named directly: read as given


def test_load_rank_is_as_strict_as_load(tmp_path: Path) -> None:
    from asyncckpt.distributed import DistributedCheckpointer, load_rank

    root = tmp_path / "dist"
    ranks = [DistributedCheckpointer(root, rank=r, world_size=2, session="s1") for r in (0, 1)]
    for step in (100, 200):
        for handle in [ckpt.save(step, {"x": torch.full((2,), float(step + r))}) for r, ckpt in enumerate(ranks)]:
            handle.result(timeout=30)
    for ckpt in ranks:
        ckpt.close()
    assert torch.equal(load_rank(root, 1)["x"], torch.full((2,), 201.0))
    (root / "step-0000000200" / MANIFEST_NAME).unlink()
    with pytest.raises(asyncckpt.CheckpointError, match=r"latest names step 200, .*step is 100"):
        load_rank(root, 1)
    assert torch.equal(load_rank(root, 1, step=100)["x"], torch.full((2,), 101.0))
