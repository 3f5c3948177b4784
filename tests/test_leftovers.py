"""A new checkpointer removes what killed processes left in its directory, and nothing of a live one's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

import asyncckpt
from asyncckpt._layout import LATEST_NAME

_PAUSED = """
import sys, torch, asyncckpt
from asyncckpt import _commit_points as commit_points
run, point = sys.argv[1], sys.argv[2]
ckpt = asyncckpt.AsyncCheckpointer(run, keep_last=1)
ckpt.save(1, {"w": torch.ones(8)}).result()


def pause(reached):
    if reached == point:
        print("paused", flush=True)
        sys.stdin.readline()  # until the parent has started its own checkpointer


commit_points.set_hook(pause)
ckpt.save(2, {"w": torch.full((8,), 2.0)}).result()
ckpt.close()
print("committed", flush=True)
"""

_KIND = {"marker-written": ".committing-step-0000000002-", "pointer-temp-written": ".latest.",
         "retention-moved-aside": ".deleting-step-0000000001-"}  # fmt: skip


@pytest.mark.parametrize("point", sorted(_KIND))
def test_a_live_processs_save_in_flight_is_left_alone(run_dir: Path, point: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED, str(run_dir), point], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "paused"
        before = sorted(p.name for p in run_dir.iterdir())
        assert any(name.startswith(_KIND[point]) for name in before), before
        with asyncckpt.AsyncCheckpointer(run_dir):  # a second process starts in the same directory
            assert sorted(p.name for p in run_dir.iterdir()) == before
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "committed"
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [2]
    assert (run_dir / LATEST_NAME).read_text().strip() == "step-0000000002"
    assert sorted(p.name for p in run_dir.iterdir()) == [LATEST_NAME, "step-0000000002"]


def test_leftovers_of_other_hosts_and_of_distributed_jobs_are_not_this_checkpointers_to_remove(run_dir: Path) -> None:
    dead_pid = 2**22 + 1  # above the default pid_max: never a live process
    others = [
        f".tmp-step-0000000005-otherhost-{dead_pid}-abcdef12",  # another host's save: its pids mean nothing here
        f".deleting-step-0000000004-otherhost-{dead_pid}-abcdef12",
        f".latest.otherhost.{dead_pid}.abcdef12",
        ".tmp-step-0000000005-dist-0123456789abcdef",  # the distributed protocol's: rank 0 removes those
        ".abort-step-0000000005-0123456789abcdef",
    ]
    run_dir.mkdir()
    for name in others:
        (run_dir / name).mkdir() if "latest" not in name and "abort" not in name else (run_dir / name).write_text("")
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        ckpt.save(1, {"w": torch.ones(1)}).result()
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == sorted(others)
