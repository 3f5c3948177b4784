"""A process SIGKILLed at every point of the commit protocol leaves a directory that reads back consistently.

Each case runs a real child process that saves two checkpoints, then SIGKILLs itself at one named
point of the third save (:mod:`asyncckpt._commit_points`). The parent then checks what a restarted
job sees: ``latest_step()``, ``list_checkpoints()`` and ``load()`` agree, a new checkpointer removes
every leftover, and the job resumes at ``latest_step() + 1``.
"""

from __future__ import annotations

import errno
import logging
import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import run_python

import asyncckpt
from asyncckpt import _commit_points as commit_points
from asyncckpt._layout import LATEST_NAME

_BEFORE_RENAME = ("tmp-created", "data-written", "manifest-written", "marker-written")

_CHILD = """
import os, signal, sys, torch, asyncckpt
from asyncckpt import _commit_points as commit_points
run, point = sys.argv[1], sys.argv[2]
ckpt = asyncckpt.AsyncCheckpointer(run, keep_last=2)
for step in (1, 2):
    ckpt.save(step, {"w": torch.full((64,), float(step))}).result()


def stop(reached):
    if reached == point:
        os.kill(os.getpid(), signal.SIGKILL)


commit_points.set_hook(stop)
ckpt.save(3, {"w": torch.full((64,), 3.0)}).result()
print("not killed", flush=True)
"""


def _agree(run_dir: Path, expected_latest: int) -> None:
    steps = [c.step for c in asyncckpt.list_checkpoints(run_dir)]
    assert asyncckpt.latest_step(run_dir) == expected_latest == max(steps), steps
    assert float(asyncckpt.load(run_dir)["w"][0]) == float(expected_latest)
    for step in steps:
        asyncckpt.verify(run_dir, step=step)


@pytest.mark.parametrize("point", commit_points.POINTS)
def test_sigkill_at_each_commit_point_reads_back_consistently_and_the_job_resumes(run_dir: Path, point: str) -> None:
    proc = run_python(_CHILD, str(run_dir), point, check=False)
    assert proc.returncode == -signal.SIGKILL, f"never reached {point!r}: {proc.stdout}{proc.stderr}"
    committed = point not in _BEFORE_RENAME
    _agree(run_dir, 3 if committed else 2)
    if point in ("renamed", "pointer-temp-written"):  # latest still names step 2; the marker says 3
        assert (run_dir / LATEST_NAME).read_text().strip() == "step-0000000002"
        assert asyncckpt.verify(run_dir).step == 3  # load() and verify() read what latest_step() says
    leftovers = [p.name for p in run_dir.iterdir() if p.name.startswith(".")]
    # The next checkpointer removes what the dead process left (all of it: the pid is dead), then resumes.
    with asyncckpt.AsyncCheckpointer(run_dir, keep_last=2) as ckpt:
        assert [p.name for p in run_dir.iterdir() if p.name.startswith(".")] == [], leftovers
        resume = asyncckpt.latest_step(run_dir)
        assert resume is not None
        ckpt.save(resume + 1, {"w": torch.full((64,), float(resume + 1))}).result()
    _agree(run_dir, resume + 1)
    assert len(asyncckpt.list_checkpoints(run_dir)) == 2  # keep_last


_TWO_RANKS = """
import os, signal, sys, torch, asyncckpt
from asyncckpt import _commit_points as commit_points
from asyncckpt.distributed import DistributedCheckpointer
run, point, session = sys.argv[1], sys.argv[2], sys.argv[3]
ranks = [DistributedCheckpointer(run, rank=r, world_size=2, session=session, commit_timeout_seconds=30)
         for r in (0, 1)]


def save(step):
    for handle in [ckpt.save(step, {"w": torch.full((64,), float(step + r))}) for r, ckpt in enumerate(ranks)]:
        handle.result(60)


def stop(reached):
    if reached == point:
        os.kill(os.getpid(), signal.SIGKILL)


if point == "-":
    save(int(os.environ["STEP"]))
else:
    save(1)
    save(2)
    commit_points.set_hook(stop)
    save(3)
    print("not killed", flush=True)
"""


@pytest.mark.distributed
@pytest.mark.parametrize("point", ["marker-written", "renamed", "pointer-temp-written"])
def test_a_distributed_job_killed_at_a_commit_point_reads_back_consistently(run_dir: Path, point: str) -> None:
    proc = run_python(_TWO_RANKS, str(run_dir), point, "dead", check=False)
    assert proc.returncode == -signal.SIGKILL, f"never reached {point!r}: {proc.stdout}{proc.stderr}"
    expected = 2 if point in ("data-written", "marker-written") else 3
    steps = [c.step for c in asyncckpt.list_checkpoints(run_dir)]
    assert asyncckpt.latest_step(run_dir) == expected == max(steps)
    for marker in run_dir.glob(".committing-*"):  # as if rank 0 had run on another host: only rank 0 finishes it
        marker.rename(run_dir / re.sub(r"-[A-Za-z0-9._]+-(\d+-[0-9a-f]{8})$", r"-otherhost-\1", marker.name))
    # The restarted job (a new session) cleans the dead one's leftovers and saves the next step.
    run_python(_TWO_RANKS, str(run_dir), "-", "alive", env={"STEP": str(expected + 1)})
    assert asyncckpt.latest_step(run_dir) == expected + 1
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".")] == []
    assert float(asyncckpt.load(run_dir)[1]["w"][0]) == float(expected + 2)


_RESTARTED = """
import os, signal, sys, torch, asyncckpt
from asyncckpt import _commit_points as commit_points
run = sys.argv[1]
ckpt = asyncckpt.AsyncCheckpointer(run)
for step in (5, 10):
    ckpt.save(step, {"w": torch.full((64,), float(step))}).result()
commit_points.set_hook(lambda point: os.kill(os.getpid(), signal.SIGKILL) if point == "renamed" else None)
ckpt.save(7, {"w": torch.full((64,), 7.0)}).result()  # a restart from step 5: a new timeline
"""


def test_a_restarted_timeline_killed_between_rename_and_pointer_keeps_its_step_as_the_latest(run_dir: Path) -> None:
    proc = run_python(_RESTARTED, str(run_dir), check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (run_dir / LATEST_NAME).read_text().strip() == "step-0000000010"
    assert asyncckpt.latest_step(run_dir) == 7  # the marker: step 7 was the most recent commit
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:  # finishes the commit: latest names step 7 for good
        assert (run_dir / LATEST_NAME).read_text().strip() == "step-0000000007"
        ckpt.save(8, {"w": torch.full((64,), 8.0)}).result()
    assert asyncckpt.latest_step(run_dir) == 8
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [5, 7, 8, 10]


def _failing_at(point: str, error: BaseException) -> None:
    def hook(reached: str) -> None:
        if reached == point:
            raise error

    commit_points.set_hook(hook)


def test_a_failed_fsync_after_the_rename_reports_the_save_committed_with_a_warning(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The rename is visible to every reader, so the save is committed (and a retry refused) either way.

    The run directory's fsync cannot be made to fail on this machine's file system; the commit
    point right before it raises the error that fsync would.
    """
    with caplog.at_level(logging.WARNING, logger="asyncckpt"), asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).result()
        _failing_at("renamed", OSError(errno.EIO, "Input/output error"))
        try:
            result = ckpt.save(2, {"w": torch.full((4,), 2.0)}).result()
        finally:
            commit_points.set_hook(None)
        assert result.step == 2
        with pytest.raises(asyncckpt.CheckpointError, match="step 2 is already saved"):
            ckpt.save(2, {"w": torch.ones(4)})
        ckpt.save(3, {"w": torch.full((4,), 3.0)}).result()
    assert "is committed and visible, but fsync of" in caplog.text and "Input/output error" in caplog.text
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [1, 2, 3]


def test_a_failure_just_before_the_rename_leaves_nothing_and_the_step_can_be_saved_again(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).result()
        _failing_at("marker-written", OSError(errno.EIO, "Input/output error"))
        try:
            with pytest.raises(asyncckpt.SaveFailedError, match="Input/output error"):
                ckpt.save(2, {"w": torch.full((4,), 2.0)}).result()
        finally:
            commit_points.set_hook(None)
        assert (run_dir / LATEST_NAME).read_text().strip() == "step-0000000001"
        assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [1]
        assert [p.name for p in run_dir.iterdir() if p.name.startswith(".")] == []
        with pytest.raises(asyncckpt.SaveFailedError):
            ckpt.save(2, {"w": torch.full((4,), 2.0)})  # the failure is raised once more
        ckpt.save(2, {"w": torch.full((4,), 2.0)}).result()  # then the step may be saved again
    assert asyncckpt.latest_step(run_dir) == 2
