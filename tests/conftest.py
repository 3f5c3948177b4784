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
    from asyncckpt.testing.demo_model import TextBatches, TinyGPT, stdlib_text, train_step

    torch.manual_seed(0)
    model = TinyGPT(width=width, layers=2, heads=2, context=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = TextBatches(stdlib_text(1 << 18), model.context, batch=4, device=torch.device("cpu"))
    for _ in range(steps):
        train_step(model, optimizer, batches)
    return model, optimizer, {"model": model.state_dict(), "optim": optimizer.state_dict()}


REFUSED_WRITES_PRELUDE = """
import asyncckpt, resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # no file of this process grows past 1 MiB


def failures(handle, ckpt):
    \"\"\"What handle.result() and then ckpt.close() raised, as text (None: nothing).\"\"\"
    out = {}
    for name, call in (("result", lambda: handle.result(60)), ("close", ckpt.close)):
        try:
            call()
            out[name] = None
        except asyncckpt.SaveFailedError as exc:
            out[name] = str(exc)
    return out
"""
"""Code for a child interpreter (:func:`run_python`) whose writes past 1 MiB fail like a full disk's."""


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


def debian_tool(name: str) -> str:
    """Path of ``name`` from Debian's prometheus package; fails in CI (CI=true), skips elsewhere, when absent."""
    import shutil

    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").is_file() else None)
    if path is None:
        message = f"{name} not found: install Debian's prometheus package (apt-get install prometheus)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; .ci/run should have", pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture
def promtool_binary() -> str:
    return debian_tool("promtool")


def free_ports(count: int = 1) -> int:
    """A port P such that P .. P+count-1 are free now on every interface (rank-offset exporters need a run)."""
    import socket

    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", 0))
            base = probe.getsockname()[1]
        if base + count > 65536:
            continue
        held = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("0.0.0.0", port))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return base
    raise RuntimeError(f"no run of {count} free ports found")
