"""Progress bars: drawn on stderr when it is a terminal (a real pseudo-terminal here), absent otherwise."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_env import REPO, cli, saved_run

from asyncckpt._commands._progress import Progress, ReadProgress


def _with_terminal_stderr(*args: str | Path, module: str = "asyncckpt") -> tuple[int, str, str]:
    """Run ``python -m MODULE ARGS`` with stderr on a pseudo-terminal; returns (status, stdout, what it got)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", module, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=follower, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)  # fmt: skip
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    stdout, _ = proc.communicate(timeout=60)
    return proc.returncode, stdout.decode(), seen.decode(errors="replace")


def test_verify_and_convert_draw_a_bar_on_a_terminal_only(tmp_path: Path) -> None:
    saved_run(tmp_path / "run")
    status, stdout, terminal = _with_terminal_stderr("verify", tmp_path / "run")
    assert status == 0 and stdout.startswith("OK:")
    assert "verify: 100% [########################]" in terminal and " MB" in terminal, terminal
    status, _, terminal = _with_terminal_stderr("convert", tmp_path / "run", tmp_path / "out", "--codec", "none")
    assert status == 0 and "read step-0000000002: 100%" in terminal and "write 2: 100%" in terminal, terminal

    piped = cli("verify", tmp_path / "run")  # stderr is a pipe: no bar
    assert piped.returncode == 0 and piped.stderr == ""


def test_the_bar_moves_with_the_work() -> None:
    stream = io.StringIO()
    with Progress("steps", 4, unit="steps", stream=stream, enabled=True, interval_seconds=0.0) as bar:
        for _ in range(4):
            bar.advance(1)
    frames = stream.getvalue().split("\r")[1:]
    assert [frame.split(":")[1].split("%")[0].strip() for frame in frames[:4]] == ["25", "50", "75", "100"]
    assert frames[-1].endswith("\n") and "4/4 steps" in frames[-1]


def test_read_progress_follows_the_bytes_this_process_reads(tmp_path: Path) -> None:
    data = tmp_path / "blob"
    data.write_bytes(os.urandom(4 << 20))
    stream = io.StringIO()
    progress = ReadProgress("read", 4 << 20, stream=stream, enabled=True)
    progress.bar.interval_seconds = 0.005
    with progress, open(data, "rb", buffering=0) as f:
        while f.read(1 << 20):
            time.sleep(0.05)  # slower than the sampler: it sees the partial reads
    percents = [int(frame.split(":")[1].split("%")[0]) for frame in stream.getvalue().split("\r")[1:]]
    assert percents[-1] == 100 and any(0 < p < 100 for p in percents), percents


@pytest.mark.slow
def test_the_stall_benchmark_draws_a_bar_under_its_progress_lines(tmp_path: Path) -> None:
    status, _, terminal = _with_terminal_stderr("--tiny", "--no-chart", "--methods", "torch.save", "--rounds", "2",
                                                "--out", tmp_path, "--name", "st", "--dir", tmp_path / "scratch",
                                                module="benchmarks.stall_time")  # fmt: skip
    assert status == 0, terminal
    assert "measured: 100% [########################] 4/4 measurements" in terminal, terminal
    # Each progress line is printed after the bar's line is erased, and the bar comes back below it.
    assert "\r\x1b[K[" in terminal and "round 2: torch.save:" in terminal


def test_the_full_gpu_benchmark_draws_a_bar_of_saves(tmp_path: Path) -> None:
    status, _, terminal = _with_terminal_stderr("--tiny", "--out", tmp_path, "--scratch", tmp_path / "s",
                                                module="benchmarks.full_gpu")  # fmt: skip
    assert status == 0, terminal
    # CPU: asyncckpt host with delta off and on, two saves each, and dcp.async_save once.
    assert "saves measured: 100% [########################] 5/5 saves" in terminal, terminal
