"""The examples run as documented: the plain loop and the torchrun example (2 ranks, gloo), each resumed once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

import asyncckpt


def _run(*argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=100, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(120)
def test_plain_training_loop_example_saves_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "loop"
    _run("examples/train_loop.py", "--dir", str(run), "--steps", "4", "--save-every", "2")
    out = _run("examples/train_loop.py", "--dir", str(run), "--steps", "6", "--save-every", "2")
    assert "resumed from step 4" in out and asyncckpt.latest_step(run) == 6


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_torchrun_example_two_ranks_saves_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "ddp"
    torchrun = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "examples/torchrun_train.py", "--dir", str(run)]
    _run(*torchrun, "--steps", "4", "--save-every", "2")
    out = _run(*torchrun, "--steps", "6", "--save-every", "2")
    assert "resumed from step 4" in out and asyncckpt.latest_step(run) == 6
    assert sorted(p.name for p in (run / "step-0000000006").iterdir()) == ["data-r0.bin", "data-r1.bin",
                                                                          "manifest.json"]  # fmt: skip
