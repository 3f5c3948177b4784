"""Shared fixtures: small real training states and a helper to run Python in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def small_training_state(steps: int = 3, width: int = 32) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """A TinyGPT and AdamW after a few real steps on stdlib text, and its state dict."""
    from asyncckpt.demo_model import TextBatches, TinyGPT, stdlib_text, train_step

    torch.manual_seed(0)
    model = TinyGPT(width=width, layers=2, heads=2, context=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = TextBatches(stdlib_text(1 << 18), model.context, batch=4, device=torch.device("cpu"))
    for _ in range(steps):
        train_step(model, optimizer, batches)
    return model, optimizer, {"model": model.state_dict(), "optim": optimizer.state_dict()}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def run_python(code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None,
               check: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run ``code`` in a fresh interpreter with the repository importable; returns the completed process."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=REPO)  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc
