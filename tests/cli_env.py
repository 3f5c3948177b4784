"""Run the real ``asyncckpt`` command line in a subprocess (``python -m asyncckpt``), for the CLI tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import asyncckpt

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``asyncckpt ARGS...`` in a fresh interpreter; returns the completed process (any exit status)."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "asyncckpt", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd or REPO)  # fmt: skip


def cli_all(*commands: list[str | Path], env: dict[str, str] | None = None,
            timeout: float = 120) -> list[subprocess.CompletedProcess[str]]:  # fmt: skip
    """Several ``asyncckpt`` runs at once (each a fresh interpreter, as :func:`cli`); results in order."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    procs = [subprocess.Popen([sys.executable, "-m", "asyncckpt", *map(str, args)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=full_env, cwd=REPO)
             for args in commands]  # fmt: skip
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


class Tied(torch.nn.Module):
    """A model with a tied weight (``head.weight`` is ``embed.weight``), as language models have."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


def saved_run(run: Path, steps: tuple[int, ...] = (1, 2)) -> Tied:
    """A run directory with one checkpoint per step of ``{"model", "optim", "step"}``; returns the model."""
    torch.manual_seed(0)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with asyncckpt.AsyncCheckpointer(run) as ckpt:
        for step in steps:
            model(torch.arange(4)).sum().backward()
            optimizer.step()
            ckpt.save(step, {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step})
    return model
