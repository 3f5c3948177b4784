"""The asyncckpt command line: demo, ls, inspect, verify, run as real subprocesses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from cli_env import cli_calls
from conftest import run_python

import asyncckpt
from asyncckpt._manifest_digest import DIGEST_FIELD, seal

CLI = "import sys; from asyncckpt.cli import main; sys.exit(main(sys.argv[1:]))"


def test_demo_trains_saves_and_restores_bit_for_bit(tmp_path: Path) -> None:
    run = tmp_path / "demo"
    proc = run_python(CLI, "demo", "--dir", str(run), "--steps", "20", "--save-every", "5", "--width", "64",
                      "--keep-last", "2", timeout=180)  # fmt: skip
    out = proc.stdout
    assert "bit-for-bit equal to the state at save() time" in out
    assert re.search(r"median stall: async [\d.]+ ms vs torch.save [\d.]+ ms", out)
    assert len(re.findall(r"^\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+", out, re.M)) == 4  # one table row per save
    assert [c.step for c in asyncckpt.list_checkpoints(run)] == [15, 20]


def test_ls_inspect_verify(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with asyncckpt.AsyncCheckpointer(run) as ckpt:
        ckpt.save(3, {"layer": {"weight": torch.zeros(64, 64), "bias": torch.ones(64, dtype=torch.bfloat16)}},
                  metadata={"epoch": 1})  # fmt: skip
    listing, inspected, verified = cli_calls(["ls", run], ["inspect", run], ["verify", run])
    assert "step-0000000003" in listing.stdout and "<- latest" in listing.stdout
    table = inspected.stdout
    assert re.search(r"layer/weight\s+float32\s+\(64, 64\)\s+cpu\s+zstd", table)
    assert re.search(r"layer/bias\s+bfloat16\s+\(64,\)", table)
    assert "{'epoch': 1}" in table
    assert verified.returncode == 0 and verified.stdout.startswith("OK:")

    manifest = run / "step-0000000003" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["tensors"][0]["checksum"]["value"] = "00000000"
    del doc[DIGEST_FIELD]
    manifest.write_bytes(seal(doc))  # resealed: the blob's checksum itself must catch it
    bad = run_python(CLI, "verify", str(run), check=False)
    assert bad.returncode == 1 and "CORRUPT" in bad.stdout and "layer/weight" in bad.stdout


def test_errors_are_one_line_with_exit_status_2(tmp_path: Path) -> None:
    proc = run_python(CLI, "inspect", str(tmp_path / "missing"), check=False)
    assert proc.returncode == 2
    assert "asyncckpt: error:" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_without_dir_leaves_nothing_behind(tmp_path: Path) -> None:
    proc = run_python(CLI, "demo", "--steps", "2", "--save-every", "1", "--width", "32", timeout=180,
                      env={"TMPDIR": str(tmp_path)})  # fmt: skip
    assert "bit-for-bit equal" in proc.stdout and "removed " in proc.stdout
    # Neither the checkpoints nor the torch.save scratch directory (torch may leave its own inductor cache).
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("asyncckpt")] == []
