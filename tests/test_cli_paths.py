"""The command line on odd input: missing paths, files where directories belong, closed pipes, no arguments.

Every command answers with one line on stderr and the exit status :mod:`asyncckpt.cli` documents
(2: could not run; 141: output pipe closed), never a traceback. Real subprocesses throughout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from cli_env import REPO, cli, cli_calls, saved_run

import asyncckpt

COMMANDS = [("ls",), ("inspect",), ("verify",), ("convert", "--to", "torch")]


def _args(command: tuple[str, ...], path: Path, tmp_path: Path) -> list[str | Path]:
    if command[0] == "convert":
        return ["convert", path, tmp_path / "out.pt", *command[1:]]
    return [*command, path]


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("asyncckpt: error: "), proc.stderr
    return lines[0]


def test_missing_odd_and_empty_paths_are_one_line_and_status_2(tmp_path: Path) -> None:
    afile = tmp_path / "notes.txt"
    afile.write_text("hello")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(command, tmp_path / "missing", "missing: no such") for command in COMMANDS]
    cases += [(command, afile, "is a file, not a") for command in COMMANDS]
    cases += [(command, empty, "no committed checkpoint") for command in COMMANDS[1:]]  # ls: an empty listing
    results = cli_calls(*(_args(command, path, tmp_path) for command, path, _ in cases))  # one interpreter
    for (command, path, expected), proc in zip(cases, results, strict=True):
        line = _one_line_error(proc)
        assert expected in line, (command, path.name, line)


def test_ls_of_an_empty_directory_lists_nothing(tmp_path: Path) -> None:
    proc = cli("ls", tmp_path)
    assert proc.returncode == 0 and "no committed checkpoints" in proc.stdout


def test_a_closed_pipe_ends_quietly_with_status_141(tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(tmp_path / "run") as ckpt:  # a table far larger than a pipe's buffer
        ckpt.save(1, {f"tensor_{i}": torch.zeros(1) for i in range(4000)})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for command in (["inspect"], ["ls"], ["inspect", "--json"]):
        reader, writer = os.pipe()
        proc = subprocess.Popen([sys.executable, "-m", "asyncckpt", *command, str(tmp_path / "run")], stdout=writer,
                                stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
        os.close(writer)
        with os.fdopen(reader, "rb") as pipe:
            pipe.read(16)  # `| head -c 16`: read a little, then close the pipe
        _, stderr = proc.communicate(timeout=60)
        if command[0] == "ls":  # two rows fit in the pipe: it finished before the pipe closed
            assert proc.returncode in (0, 141) and stderr == "", stderr
            continue
        assert proc.returncode == 141, (command, proc.returncode, stderr)
        assert stderr == "", stderr


def test_version_and_no_arguments(tmp_path: Path) -> None:
    version = cli("--version")
    assert version.returncode == 0 and version.stdout.startswith(f"asyncckpt {asyncckpt.__version__} (torch ")
    bare = cli(env={"TMPDIR": str(tmp_path)})
    assert bare.returncode == 0 and bare.stdout.startswith("usage: asyncckpt") and "convert" in bare.stdout
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("asyncckpt")] == []  # it ran no demo


def test_convert_refuses_to_overwrite_an_export(tmp_path: Path) -> None:
    saved_run(tmp_path / "run")
    (tmp_path / "out.pt").write_text("keep me")
    line = _one_line_error(cli("convert", tmp_path / "run", tmp_path / "out.pt", "--to", "torch"))
    assert "already exists" in line and (tmp_path / "out.pt").read_text() == "keep me"


def test_latest_naming_a_missing_checkpoint_is_refused_not_replaced(tmp_path: Path) -> None:
    """inspect, verify and convert resolve a run directory as load() does: when ``latest`` names a
    checkpoint that is gone, they say so instead of reading an older one."""
    run = tmp_path / "run"
    with asyncckpt.AsyncCheckpointer(run, codec="zstd") as ckpt:
        for step in (100, 200):
            ckpt.save(step, {"w": torch.full((64,), float(step))}).result()
    (run / "step-0000000200" / "manifest.json").unlink()
    results = cli_calls(*(_args(command, run, tmp_path) for command in COMMANDS[1:]))
    for command, proc in zip(COMMANDS[1:], results, strict=True):
        line = _one_line_error(proc)
        assert "names step 200" in line and "not falling back" in line, (command, line)
