"""Run the real ``asyncckpt`` command line in a subprocess (``python -m asyncckpt``), for the CLI tests."""

from __future__ import annotations

import json
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


_CALLS = """
import contextlib, io, json, sys
from asyncckpt.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's own exits (usage errors, --help)
            status = exc.code if isinstance(exc.code, int) else 1
    results.append([status, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def cli_calls(*commands: list[str | Path], env: dict[str, str] | None = None,
              timeout: float = 120) -> list[subprocess.CompletedProcess[str]]:  # fmt: skip
    """Several ``asyncckpt`` commands through the real ``asyncckpt.cli.main`` in one fresh interpreter.

    One interpreter start (torch's import) for all of them instead of one each; what the command
    line does per command (arguments, exit status, stdout, stderr) is the same. Results in order.
    """
    argvs = [[str(a) for a in args] for args in commands]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run([sys.executable, "-c", _CALLS, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [subprocess.CompletedProcess(argv, status, out, err) for argv, (status, out, err)
            in zip(argvs, json.loads(proc.stdout.splitlines()[-1]), strict=True)]  # fmt: skip


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
