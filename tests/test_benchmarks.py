"""Smoke tests of the benchmarks at --tiny size: the structure of what they write, not their timings.

The stall-time and compression benchmarks run as real subprocesses (as a user runs them); the
cost model's arithmetic is checked against figures worked out by hand.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "docs" / "tools"))  # the cost model and report scripts

import cost_model  # noqa: E402
import report  # noqa: E402

from benchmarks.common import median, p95  # noqa: E402


def run_module(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def stall_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("stall")
    scratch = out / "scratch"
    proc = run_module("-m", "benchmarks.stall_time", "--tiny", "--out", str(out), "--name", "stall_time",
                      "--dir", str(scratch), "--methods", "default,asyncckpt:device:auto")  # fmt: skip
    return out, proc


def test_stall_time_writes_json_markdown_and_chart(stall_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = stall_run
    report = json.loads((out / "stall_time.json").read_text())
    assert report["benchmark"] == "stall_time" and report["tiny"] is True
    assert report["machine"]["cpu_cores"] >= 1 and report["versions"]["torch"]
    assert report["command"].startswith("python -m benchmarks.stall_time --tiny")
    storage, copies = report["limits"]["storage"], report["limits"]["copies"]
    assert storage["write_bytes_per_second"] > 0 and storage["read_bytes_per_second"] > 0
    assert copies["host_copy_bytes_per_second"] > 0
    names = [m["name"] for m in report["methods"]]
    assert names[0] == "baseline"
    expected = {"torch.save", "dcp.save", "dcp.async_save", "asyncckpt:host:auto", "asyncckpt:host:none"}
    assert expected <= set(names)
    state_bytes = report["model"]["state_bytes"]
    for entry in report["methods"]:
        if entry["name"] in expected:
            assert entry["available"] and entry["error"] is None, entry
            (sample,) = entry["samples"]  # --tiny: one round
            assert sample["raw_bytes"] == state_bytes
            assert sample["stored_bytes"] > 0 and sample["blocked_seconds"] > 0
            assert sample["durable_seconds"] >= 0 and sample["steps_after"] >= 3
            summary = entry["summary"]
            assert summary["blocked_seconds_median"] == sample["blocked_seconds"]
            assert summary["ratio"] == pytest.approx(state_bytes / sample["stored_bytes"])
    ours = next(m for m in report["methods"] if m["name"] == "asyncckpt:host:auto")
    assert ours["samples"][0]["snapshot_mode"] == "host" and "zstd" in ours["samples"][0]["codecs"]
    baseline = report["methods"][0]
    assert baseline["summary"]["step_seconds_median"] > 0
    # A method this machine cannot run is a row with the reason, not a crash.
    device = next(m for m in report["methods"] if m["name"] == "asyncckpt:device:auto")
    assert not device["available"]
    assert device["unavailable"].split(":")[0] in ("CheckpointError", "MissingDependencyError")
    # Every checkpoint was deleted after it was measured, and the scratch directory left empty.
    assert list((out / "scratch").iterdir()) == []


def test_stall_time_markdown_on_stdout(stall_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, proc = stall_run
    markdown = (out / "stall_time.md").read_text()
    assert markdown.strip() in proc.stdout
    assert "| method | blocked per save, median (p95) |" in markdown
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 7  # header + every method but the baseline
    assert re.search(r"\| asyncckpt device snapshot, auto codec \| unavailable: \w+Error: ", markdown)
    assert "round 1: torch.save: blocked" in proc.stderr  # progress goes to stderr
    assert (out / "stall_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_imports_a_run_and_refreshes_the_doc(
    stall_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    out, _ = stall_run
    (out / "run.log").write_text("[run_h200 +0s] machine\n")
    results = tmp_path / "results"
    results.mkdir()
    copied = report.import_run(out, results)
    names = sorted(p.name for p in copied)
    assert len(names) == 4 and names[0].startswith("run_h200-") and names[0].endswith("-cpu.log")
    assert {n.rsplit(".", 1)[1] for n in names} == {"log", "json", "md", "png"}
    assert all(n.split("-")[1].isdigit() for n in names)  # stems carry the UTC date
    # The committed doc's generated blocks fill from the committed results, and a second pass changes nothing.
    doc = tmp_path / "benchmarks.md"
    shutil.copyfile(REPO / "docs" / "benchmarks.md", doc)
    assert set(report.refresh(doc)) == {"headline", "stall-gpu", "stall-cpu", "compression-gpu", "compression-cpu",
                                        "cost"}  # fmt: skip
    first = doc.read_text()
    report.refresh(doc)
    assert doc.read_text() == first
    assert "| way to save | training blocked per save | durable after | bytes stored |" in first


def test_flatten_time_tiny_compares_two_trees() -> None:
    proc = run_module("benchmarks/flatten_time.py", str(REPO), str(REPO), "--tiny")
    report = json.loads(proc.stdout)
    assert report["tensors"] == 32  # 4 layers x (weight, bias) x (the tensor, step, exp_avg, exp_avg_sq)
    for measure in ("flatten", "whole", "full"):
        assert report[measure]["baseline_us"] > 0 and report[measure]["ratio_new_over_baseline"] > 0


def test_compression_tiny(tmp_path: Path) -> None:
    proc = run_module("-m", "benchmarks.compression", "--tiny", "--out", str(tmp_path), "--name", "c")
    report = json.loads((tmp_path / "c.json").read_text())
    classes = report["classes"]
    assert list(classes) == ["weights_fp32", "weights_bf16", "exp_avg", "exp_avg_sq", "grads_fp32", "grads_bf16"]
    for name, entry in classes.items():
        planes = 2 if "bf16" in name else 4
        entropy = entry["entropy"]
        assert len(entropy["plane_bits_per_byte"]) == planes
        assert all(0 <= bits <= 8 for bits in entropy["plane_bits_per_byte"])
        assert entropy["bound_ratio_planes"] >= 1.0
        for codec in ("auto", "zstd", "none"):
            result = entry["library"][codec]
            assert result["ratio"] > 0 and result["compress_bytes_per_second"] > 0
            assert result["roundtrip_exact"] is True
        assert entry["auto_chose"]["codec"] == "zstd"
        assert entry["library"]["none"]["ratio"] == pytest.approx(1.0)
        assert set(entry["cpu"]) == {"zstd-1 planes", "zstd-3 planes", "zstd-1 no planes"}
    assert "ans" in report["library_unavailable"]  # GPU-only codecs are listed as unavailable on a CPU machine
    assert "| asyncckpt `auto` |" in proc.stdout and "order-0 limit" in proc.stdout


def _inputs(**overrides: float) -> cost_model.Inputs:
    values = {"weights_ratio": 1.5, "moments_ratio": 1.2, "grads_ratio": 2.0, "dcp_zstd_ratio": 1.05,
              "dcp_stage_bytes_per_second": 5e9, "ours_stage_bytes_per_second": 500e9,
              "dcp_persist_step_ratio": 1.0, "ours_persist_step_ratio": 1.1, **overrides}  # fmt: skip
    return cost_model.Inputs(**values, sources={})


def test_cost_model_arithmetic() -> None:
    scenario = cost_model.Scenario("70B", 70e9, gpus=8, storage_bytes_per_second=5e9)
    row = cost_model.monthly(scenario, _inputs(), saves_per_month=1440, price=2.0)
    assert row["checkpoint_bytes"] == pytest.approx(840e9)  # 70e9 * (2 + 8 + 2)
    sync = row[cost_model.SYNC]
    assert sync["blocked_seconds"] == pytest.approx(168.0)  # 840 GB at 5 GB/s
    assert sync["gpu_hours_per_month"] == pytest.approx(8 * 168 * 1440 / 3600)
    assert sync["cost_per_month"] == pytest.approx(2.0 * sync["gpu_hours_per_month"])
    dcp = row[cost_model.DCP_ASYNC]
    assert dcp["blocked_seconds"] == pytest.approx(105e9 / 5e9)  # the 105 GB shard at 5 GB/s
    assert dcp["slowdown_seconds"] == 0.0
    ours = row[cost_model.OURS]
    stored = 140e9 / 1.5 + 560e9 / 1.2 + 140e9 / 2.0
    assert ours["stored_bytes"] == pytest.approx(stored)
    assert ours["blocked_seconds"] == pytest.approx(105e9 / 500e9)
    assert ours["slowdown_seconds"] == pytest.approx(0.1 * stored / 5e9)
    assert ours["bytes_per_month"] == pytest.approx(stored * 1440)
    assert ours["staging"] == "gpu"  # no host-mode rate measured: the GPU rate stands for every shard size


def test_cost_model_stages_large_shards_on_the_host() -> None:
    inputs = _inputs(ours_host_stage_bytes_per_second=20e9, ours_host_persist_step_ratio=1.0)
    small = cost_model.per_save(cost_model.Scenario("70B", 70e9, 128, 5e9), inputs)[cost_model.OURS]
    large = cost_model.per_save(cost_model.Scenario("70B", 70e9, 8, 5e9), inputs)[cost_model.OURS]
    assert small["staging"] == "gpu" and small["blocked_seconds"] == pytest.approx(840e9 / 128 / 500e9)
    assert large["staging"] == "host" and large["blocked_seconds"] == pytest.approx(105e9 / 20e9)
    assert large["slowdown_seconds"] == 0.0  # the host mode's own slowdown ratio (1.0), not the GPU mode's


def test_cost_model_reads_results_and_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stall = {"model": {"device": "cuda"}, "methods": [
        {"name": "dcp.async_save", "available": True, "samples": [{}],
         "summary": {"raw_bytes": 10e9, "blocked_seconds_median": 2.0, "next_step_extra_seconds": 0.5,
                     "persist_step_ratio": 1.3}},
        {"name": "dcp.async_save+zstd", "available": True, "samples": [{}], "summary": {"ratio": 1.07}},
        {"name": "asyncckpt:fence:auto", "available": True, "samples": [{}],
         "summary": {"raw_bytes": 10e9, "blocked_seconds_median": 0.001, "next_step_extra_seconds": 0.009,
                     "persist_step_ratio": 1.02, "ratio": 1.2}},
    ]}  # fmt: skip
    (tmp_path / "stall_time-20260101-000000-h200.json").write_text(json.dumps(stall))
    assert cost_model.main(["--results-dir", str(tmp_path), "--gpus", "8,128", "--storage-gbps", "5",
                            "--large-params", "0", "--moments-ratio", "1.25", "--out", str(tmp_path)]) == 0  # fmt: skip
    report = json.loads((tmp_path / "cost_model.json").read_text())
    inputs = report["inputs"]
    assert inputs["dcp_stage_bytes_per_second"] == pytest.approx(10e9 / 2.5)
    assert inputs["ours_stage_bytes_per_second"] == pytest.approx(10e9 / 0.01)
    assert inputs["ours_persist_step_ratio"] == 1.02 and inputs["dcp_zstd_ratio"] == 1.07
    assert inputs["moments_ratio"] == 1.25 and inputs["sources"]["moments_ratio"] == "flag"
    assert inputs["weights_ratio"] == 1.2  # no compression results: the whole state's ratio
    assert len(report["rows"]) == 2 * 2  # 2 GPU counts x (5 GB/s + GDS)
    assert "| 70B, 840 GB | 128 (6.56 GB) | 15 GB/s (GDS) |" in capsys.readouterr().out


def test_cost_model_without_measurements_says_which_flags(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--dcp-stage-gbps"):
        cost_model.main(["--results-dir", str(tmp_path)])


def test_bench_command_says_it_needs_a_source_checkout() -> None:
    from asyncckpt._commands.bench import _checkout_root
    from asyncckpt.errors import CheckpointError

    assert _checkout_root("docs/tools/cost_model.py") == REPO
    with pytest.raises(CheckpointError, match="source checkout"):
        _checkout_root("benchmarks/not_shipped.py")


def test_bench_command_runs_the_cost_model() -> None:
    code = "import sys; from asyncckpt.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = run_module("-c", code, "bench", "cost", "--gpus", "8", "--large-params", "0", "--weights-ratio", "1.4",
                      "--moments-ratio", "1.1", "--grads-ratio", "1.3", "--dcp-stage-gbps", "4",
                      "--ours-stage-gbps", "300", "--dcp-persist-step-ratio", "1", "--ours-persist-step-ratio", "1",
                      "--results-dir", str(REPO / "tests"), timeout=60)  # fmt: skip
    assert "### Checkpointing cost per month" in proc.stdout
    assert "| 70B, 840 GB | 8 (105 GB) | 5 GB/s |" in proc.stdout


def test_statistics() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([1.0, 2.0]) == 1.5 and median([]) is None
    assert p95([float(i) for i in range(1, 101)]) == 95.0
    assert p95([1.0, 9.0]) == 9.0 and p95([]) is None


def test_gpu_pipeline_judges_blocked_time_on_the_median_of_its_samples() -> None:
    """The GPU benchmark's verdicts, recomputed from a committed H200 report with samples put in."""
    from benchmarks import gpu_pipeline

    committed = sorted((REPO / "benchmarks" / "results").glob("gpu-pipeline-*-h200.json"))
    assert committed, "no committed GPU pipeline result to check the verdicts against"
    report_ = json.loads(committed[-1].read_text())
    fence = report_["pipeline"]["modes"]["fence"]
    fence["blocked_samples_seconds"] = [1.5e-3, 2.4e-3, 1.8e-3]
    report_["pipeline"]["dcp_async_save"] = {"blocked_seconds": 0.9, "durable_seconds": 30.0}
    verdict = gpu_pipeline.verdicts(report_)["fence"]
    assert verdict["blocked_seconds"] == pytest.approx(1.8e-3)
    assert verdict["blocked_ok"] and verdict["blocked_max_seconds"] == pytest.approx(2.4e-3)
    assert verdict["vs_dcp_async_save"] == pytest.approx(500) and verdict["vs_dcp_ok"]
    report_["verdicts"] = gpu_pipeline.verdicts(report_)
    assert "1.8 ms ok (max 2.4 ms, n=3)" in gpu_pipeline.markdown(report_)
    fence["save"]["compress"]["notes"] = ["GPU memory ran short while compressing"]
    assert "- `fence` ran as `fence`" in gpu_pipeline.markdown(report_)  # which mode ran, and how it degraded
    assert "degradations: GPU memory ran short while compressing." in gpu_pipeline.markdown(report_)

    fence["blocked_samples_seconds"] = [2.1e-3, 1.2e-3, 2.2e-3]  # a median over the bound misses it
    assert not gpu_pipeline.verdicts(report_)["fence"]["blocked_ok"]


def test_full_gpu_tiny(tmp_path: Path) -> None:
    """The full-GPU benchmark end to end at CPU size: every row measured, the report and chart written."""
    proc = run_module("-m", "benchmarks.full_gpu", "--tiny", "--saves", "3", "--batch", "3", "--out", str(tmp_path),
                      "--scratch", str(tmp_path / "s"))  # fmt: skip
    (report_path,) = tmp_path.glob("full_gpu-*.json")
    data = json.loads(report_path.read_text())
    (size,) = data["sizes"]
    assert (size["batch"], size["context"]) == (3, 64), "the step asked for (batch), the tiny default (context)"
    assert "at 3 x 64 tokens" in report_path.with_suffix(".md").read_text()
    rows = size["rows"]
    assert {r["method"] for r in rows} == {"asyncckpt:host:auto", "asyncckpt:host:auto:delta", "dcp.async_save"}
    for row in rows:
        assert "error" not in row, row
        assert row["durable_seconds"] > 0 and row["stored_bytes"] > 0
        assert row["lost_seconds"] >= row["call_seconds"] > 0
    # The delta method kept its chain's base on disk between saves (deleting it would fail the next
    # save's commit), so its later saves are deltas: a few steps of drift store fewer bytes.
    first, *later = (r for r in rows if r["method"] == "asyncckpt:host:auto:delta")
    assert len(later) == 2 and all(r["stored_bytes"] < first["stored_bytes"] for r in later), rows
    assert report_path.with_suffix(".png").stat().st_size > 0
    assert "training time lost" in proc.stdout
    assert not list((tmp_path / "s").rglob("step-*")), "checkpoints are deleted after measuring"


def test_delta_tiny(tmp_path: Path) -> None:
    """The delta benchmark end to end at CPU size: ratios per class and interval, a chain saved with
    and without deltas while training runs, and the deepest checkpoint restored bit for bit."""
    proc = run_module("-m", "benchmarks.delta", "--tiny", "--precisions", "fp32", "--references", "full,previous",
                      "--out", str(tmp_path), "--scratch", str(tmp_path / "s"))  # fmt: skip
    (report_path,) = tmp_path.glob("delta-*.json")
    data = json.loads(report_path.read_text())
    (run,) = data["ratios"]
    for measured in run["intervals"].values():
        whole = measured["whole_state"]["ratio"]
        assert whole["best"] >= max(whole["full"], whole["xor"], whole["sub"]) - 1e-9  # per tensor, the smallest
        assert whole["sub"] > whole["full"], "a few steps of drift: the delta must beat the full state"
    chain, restores = data["chain"], data["chain"]["restores"]
    off = chain["saves"]["off"]
    assert all(restore["bit_exact"] for restore in restores.values())
    assert restores["off"]["read_bytes"] == off[-1]["stored_bytes"], "a full restore reads its own blobs"
    for mode in ("full", "previous"):
        on = chain["saves"][mode]
        assert on[0]["stored_bytes"] >= 0.9 * off[0]["stored_bytes"]  # the first save of a chain is full
        assert on[-1]["stored_bytes"] < off[-1]["stored_bytes"]
        # The deepest delta's restore reads its bases' blobs too, never more than the chain holds.
        assert on[-1]["stored_bytes"] < restores[mode]["read_bytes"] <= sum(s["stored_bytes"] for s in on)
    for row in (row for rows in chain["saves"].values() for row in rows):
        assert len(row["step_ms"]) == row["steps_while_persisting"]
        assert row["lost_seconds"] >= row["call_seconds"]
        assert "snapshot_mode" not in row, "the CPU path always stages on the host: no mode to report"
    # Against the full save, the last checkpoint's restore reads it and the full save only.
    full = chain["saves"]["full"]
    assert restores["full"]["read_bytes"] <= full[-1]["stored_bytes"] + full[0]["stored_bytes"]
    assert restores["full"]["read_bytes"] < restores["previous"]["read_bytes"]
    assert "Restore of each checkpointer's last checkpoint" in proc.stdout
    assert not list((tmp_path / "s").rglob("step-*")), "checkpoints are deleted after measuring"


def test_train_while_saving_splits_off_the_steps_after_durable(tmp_path: Path) -> None:
    """A real save on the CPU path; ``settled`` turns true on its third call, and it is first called once
    the save is durable, so exactly two steps run after durable, and their excess is part of the loss."""
    import asyncckpt
    from benchmarks.common import Workload, WorkloadConfig, train_while_saving

    work = Workload(WorkloadConfig(width=32, layers=1, context=16, batch=2, device="cpu"))
    handles: list[asyncckpt.SaveHandle] = []
    durable_at_each_call: list[bool] = []

    def save() -> asyncckpt.SaveHandle:
        handles.append(ckpt.save(1, {"model": work.model.state_dict()}))
        return handles[0]

    def settled() -> bool:
        durable_at_each_call.append(handles[0].done())
        return len(durable_at_each_call) == 3

    with asyncckpt.AsyncCheckpointer(tmp_path, codec="none") as ckpt:
        handle, cost = train_while_saving(work, save, baseline_seconds=0.0, settled=settled)
        handle.result()
    assert all(durable_at_each_call), "settled() is asked only once the checkpoint is durable"
    assert cost["steps_after_durable"] == 2
    assert len(cost["step_ms"]) == cost["steps_while_persisting"] >= 2
    after = sum(cost["step_ms"][-2:]) / 1e3  # baseline 0: every step's whole time is excess
    assert cost["lost_after_durable_seconds"] == pytest.approx(after, abs=1e-4)
    assert cost["lost_seconds"] >= cost["call_seconds"] + cost["lost_after_durable_seconds"] - 1e-4


def test_host_staging_tiny(tmp_path: Path) -> None:
    """The host-staging rates at CPU size: every host-side row measured (the bounce ring's copy is
    checked byte for byte inside), the report written with the kernel's THP settings."""
    run_module("-m", "benchmarks.host_staging", "--tiny", "--threads", "1,2", "--out", str(tmp_path))
    (report_path,) = tmp_path.glob("host-staging-*.json")
    data = json.loads(report_path.read_text())
    names = [r["name"] for r in data["rows"]]
    assert any(n.startswith("fault in x2") for n in names) and any(n.startswith("pin x2") for n in names)
    assert sum("bounce" in n for n in names) == 2
    assert all(r["seconds"] > 0 and r["bytes_per_second"] > 0 for r in data["rows"]), data["rows"]
    assert "transparent_huge_pages" in data


def test_a_delta_save_that_would_not_fit_the_disk_is_not_taken(tmp_path: Path) -> None:
    """The full-GPU benchmark keeps a delta chain's base on disk: before the next save it checks that
    a save as large as the largest so far fits beside it (a 64 GB disk held a 28 GB base and one
    28 GB save, not a third), and says why not."""
    import shutil

    from benchmarks.full_gpu import disk_short_for

    free = shutil.disk_usage(tmp_path).free
    assert disk_short_for(tmp_path, []) == ""
    assert disk_short_for(tmp_path, [{"stored_bytes": 1 << 20}, {"error": "an earlier failure"}]) == ""
    why = disk_short_for(tmp_path, [{"stored_bytes": 2 * free}])
    assert "not taken" in why and str(tmp_path) in why
