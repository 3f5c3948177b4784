"""``ls``, ``inspect`` and ``verify`` with ``--json``, and ``ls`` going on past a bad checkpoint. Real subprocesses."""

from __future__ import annotations

import json
from pathlib import Path

from cli_env import cli, cli_calls, saved_run


def test_ls_reports_a_bad_checkpoint_in_its_row_and_goes_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    saved_run(run, steps=(1, 2, 3))
    (run / "step-0000000002" / "manifest.json").write_text("{not json")
    proc, listed = cli_calls(["ls", run], ["ls", run, "--json"])
    assert proc.returncode == 1, proc.stderr  # something listed is corrupt
    rows = proc.stdout.splitlines()[1:]
    assert len(rows) == 3 and "Traceback" not in proc.stderr
    assert "step-0000000001" in rows[0] and "CORRUPT" not in rows[0]
    assert "CORRUPT:" in rows[1] and "step-0000000002" in rows[1]
    assert "step-0000000003" in rows[2] and "<- latest" in rows[2] and "CORRUPT" not in rows[2]

    doc = json.loads(listed.stdout)
    by_step = {row["step"]: row for row in doc["checkpoints"]}
    assert sorted(by_step) == [1, 2, 3] and "error" in by_step[2] and "raw_bytes" not in by_step[2]
    manifest = json.loads((run / "step-0000000003" / "manifest.json").read_text())
    assert by_step[3]["latest"] and by_step[3]["tensors"] == len(manifest["tensors"])


def test_inspect_and_verify_json(tmp_path: Path) -> None:
    run = tmp_path / "run"
    saved_run(run, steps=(4,))
    checkpoint = run / "step-0000000004"
    manifest = json.loads((checkpoint / "manifest.json").read_text())

    inspected, ok = cli_calls(["inspect", run, "--json"], ["verify", run, "--json"])
    doc = json.loads(inspected.stdout)
    assert doc["step"] == 4 and doc["path"] == str(checkpoint)
    assert [t["key"] for t in doc["tensors"]] == [t["key"] for t in manifest["tensors"]]
    assert doc["raw_bytes"] == sum(t["raw_bytes"] for t in manifest["tensors"])
    assert {"dtype", "shape", "codec", "stored_bytes", "checksum"} <= set(doc["tensors"][0])

    report = json.loads(ok.stdout)
    assert ok.returncode == 0 and report["ok"] is True and report["step"] == 4
    assert report["tensors"] == len(manifest["tensors"])

    data = checkpoint / manifest["tensors"][0]["file"]
    blob = bytearray(data.read_bytes())
    offset = manifest["tensors"][0]["offset"]
    blob[offset] ^= 0xFF  # one flipped bit pattern in the first blob
    data.write_bytes(bytes(blob))
    bad = cli("verify", run, "--json")
    report = json.loads(bad.stdout)
    assert bad.returncode == 1 and report["ok"] is False and manifest["tensors"][0]["key"] in report["error"]
