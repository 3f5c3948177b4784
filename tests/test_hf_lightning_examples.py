"""The Hugging Face and Lightning examples run as documented: trained, resumed once, reloaded by the framework."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytest.importorskip("transformers")
pytest.importorskip("lightning")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # four framework start-ups: ~10 s each


def _run(*argv: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=200, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_hf_trainer_example(tmp_path: Path) -> None:
    run = tmp_path / "hf"
    first = _run("examples/hf_trainer.py", "--dir", str(run), "--steps", "4", "--save-steps", "2")
    assert "starting from scratch" in first and "from_pretrained" in first and first.rstrip().endswith("True")
    second = _run("examples/hf_trainer.py", "--dir", str(run), "--steps", "6", "--save-steps", "2")
    assert f"resuming from {run / 'checkpoint-4'}" in second
    assert "step 6;" in second and second.rstrip().endswith("True")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_lightning_example(tmp_path: Path) -> None:
    run = tmp_path / "pl"
    first = _run("examples/lightning_fit.py", "--dir", str(run), "--epochs", "1")
    assert "starting from scratch" in first and first.rstrip().endswith("True")
    second = _run("examples/lightning_fit.py", "--dir", str(run), "--epochs", "2")
    assert "resuming from" in second and "epoch 2, step 16;" in second and second.rstrip().endswith("True")
