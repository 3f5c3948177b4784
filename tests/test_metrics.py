"""Metrics: the figures a real checkpointer reports into a registry are exactly what it saved."""

from __future__ import annotations

import importlib.metadata
import math
import shutil
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

import asyncckpt
from asyncckpt.metrics import SAVE_RESULTS, STALL_BUCKETS_SECONDS, sync_equivalent_seconds
from asyncckpt.result import STAGES, SaveResult

# Known tensor bytes: 1000 float32 (4000 B) + 64x64 float64 (32768 B) + 7 int16 (14 B).
KNOWN_RAW_BYTES = 4000 + 32768 + 14


def known_state(step: int) -> dict[str, object]:
    torch.manual_seed(step)
    return {
        "w": torch.arange(1000, dtype=torch.float32) * step,
        "m": torch.randn(64, 64, dtype=torch.float64),
        "ids": torch.arange(7, dtype=torch.int16),
        "step": step,
        "note": "metrics",
    }


def installed(prefix: str) -> str:
    for name in (prefix, f"{prefix}-cu12", f"{prefix}-cu13"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "none"


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    sample = registry.get_sample_value(name, labels)
    assert sample is not None, f"{name}{labels} is not exported"
    return sample


def test_counters_equal_what_was_saved(run_dir: Path) -> None:
    registry = CollectorRegistry()
    began = time.time()
    saves = 4
    with asyncckpt.AsyncCheckpointer(run_dir, registry=registry, max_inflight=2) as ckpt:
        handles = [ckpt.save(step, known_state(step)) for step in range(1, saves + 1)]
        results = [h.result() for h in handles]
    assert all(r.raw_bytes == KNOWN_RAW_BYTES for r in results)

    assert value(registry, "asyncckpt_saves_total", result="committed") == saves
    assert value(registry, "asyncckpt_saves_total", result="failed") == 0
    assert value(registry, "asyncckpt_saves_total", result="skipped") == 0
    assert value(registry, "asyncckpt_raw_bytes_total") == saves * KNOWN_RAW_BYTES
    stored = sum(r.stored_bytes for r in results)
    assert value(registry, "asyncckpt_stored_bytes_total") == stored
    # What the metric says was stored is what is on disk.
    assert stored == sum(asyncckpt.verify(run_dir, step).stored_bytes for step in range(1, saves + 1))
    assert value(registry, "asyncckpt_compression_saved_bytes_total") == saves * KNOWN_RAW_BYTES - stored

    assert value(registry, "asyncckpt_save_stall_seconds_count") == saves
    assert value(registry, "asyncckpt_save_stall_seconds_sum") == pytest.approx(sum(r.stall_seconds for r in results))
    idle = sum(r.gpu_idle_seconds for r in results)
    assert idle == pytest.approx(sum(r.stall_seconds for r in results))  # CPU tensors: no GPU time on top
    assert value(registry, "asyncckpt_gpu_idle_seconds_total") == pytest.approx(idle)
    equivalent = [r.raw_bytes * (r.stage_seconds["write"] + r.stage_seconds["fsync"]) / r.stored_bytes for r in results]
    assert value(registry, "asyncckpt_gpu_idle_sync_equivalent_seconds_total") == pytest.approx(sum(equivalent))
    avoided = sum(max(0.0, e - r.gpu_idle_seconds) for e, r in zip(equivalent, results, strict=True))
    assert value(registry, "asyncckpt_gpu_idle_avoided_seconds_total") == pytest.approx(avoided)
    for stage in STAGES:
        expected = sum(r.stage_seconds[stage] for r in results)
        assert value(registry, "asyncckpt_stage_seconds_total", stage=stage) == pytest.approx(expected), stage
        assert expected > 0, stage

    assert value(registry, "asyncckpt_inflight_saves") == 0
    assert value(registry, "asyncckpt_staging_bytes") == 0
    assert began <= value(registry, "asyncckpt_last_success_timestamp_seconds") <= time.time()
    info = [s for m in registry.collect() if m.name == "asyncckpt_build_info" for s in m.samples]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels == {
        "version": asyncckpt.__version__, "torch": torch.__version__, "nvcomp": installed("nvidia-nvcomp"),
        "kvikio": installed("kvikio"), "codec": "auto", "io_mode": "posix", "snapshot_mode": "host",
    }  # fmt: skip

    loaded = asyncckpt.load(run_dir)
    assert loaded["step"] == saves
    assert value(registry, "asyncckpt_load_seconds_count") == 1
    assert value(registry, "asyncckpt_load_seconds_sum") > 0


def test_stall_histogram_buckets_span_100us_to_10min(run_dir: Path) -> None:
    registry = CollectorRegistry()
    with asyncckpt.AsyncCheckpointer(run_dir, registry=registry) as ckpt:
        ckpt.save(1, known_state(1)).result()
    bounds = sorted(
        float(s.labels["le"]) for m in registry.collect() if m.name == "asyncckpt_save_stall_seconds"
        for s in m.samples if s.name.endswith("_bucket")
    )  # fmt: skip
    assert bounds[0] == 1e-4 and bounds[-2] == 600.0 and math.isinf(bounds[-1])
    assert tuple(bounds[:-1]) == STALL_BUCKETS_SECONDS
    assert value(registry, "asyncckpt_save_stall_seconds_bucket", le="+Inf") == 1


def test_failed_save_is_counted_and_releases_gauges(run_dir: Path) -> None:
    registry = CollectorRegistry()
    ckpt = asyncckpt.AsyncCheckpointer(run_dir, registry=registry)
    ckpt.save(1, known_state(1)).result()
    shutil.rmtree(run_dir)
    run_dir.write_bytes(b"")  # a file where the run directory was: the worker cannot recreate it, a real failure
    handle = ckpt.save(2, known_state(2))
    assert handle.wait(30)
    with pytest.raises(asyncckpt.SaveFailedError):
        ckpt.close()
    assert value(registry, "asyncckpt_saves_total", result="failed") == 1
    assert value(registry, "asyncckpt_saves_total", result="committed") == 1
    assert value(registry, "asyncckpt_inflight_saves") == 0
    assert value(registry, "asyncckpt_staging_bytes") == 0
    assert value(registry, "asyncckpt_raw_bytes_total") == KNOWN_RAW_BYTES  # only the committed save's bytes
    # The failed save's stall kept training waiting all the same: it is GPU idle time.
    assert value(registry, "asyncckpt_save_stall_seconds_count") == 2
    stall_sum = value(registry, "asyncckpt_save_stall_seconds_sum")
    assert value(registry, "asyncckpt_gpu_idle_seconds_total") == pytest.approx(stall_sum)


def test_skipped_saves_are_counted(run_dir: Path) -> None:
    registry = CollectorRegistry()
    # 16 MiB of random int32 keeps zstd busy for a while, so a save issued right after finds no free slot.
    big = {"w": torch.randint(0, 2**31 - 1, (4 << 20,), dtype=torch.int32)}
    handles = []
    with asyncckpt.AsyncCheckpointer(run_dir, registry=registry, when_busy="skip", max_inflight=1) as ckpt:
        for step in range(1, 41):
            handles.append(ckpt.save(step, big))
            if any(h.result().skipped for h in handles if h.done()):
                break
    results = [h.result() for h in handles]
    skipped = sum(r.skipped for r in results)
    assert skipped >= 1, "no save was skipped: the worker was never busy"
    assert value(registry, "asyncckpt_saves_total", result="skipped") == skipped
    assert value(registry, "asyncckpt_saves_total", result="committed") == len(results) - skipped
    assert value(registry, "asyncckpt_save_stall_seconds_count") == len(results) - skipped


def test_gauges_track_inflight_saves(run_dir: Path) -> None:
    registry = CollectorRegistry()
    big = {"w": torch.randint(0, 2**31 - 1, (1 << 20,), dtype=torch.int32)}
    with asyncckpt.AsyncCheckpointer(run_dir, registry=registry, max_inflight=3) as ckpt:
        for step in range(1, 4):
            ckpt.save(step, big)
            # At every moment: staged saves = in flight + committed + failed.
            inflight = value(registry, "asyncckpt_inflight_saves")
            done = value(registry, "asyncckpt_saves_total", result="committed")
            assert inflight + done == step
            assert value(registry, "asyncckpt_staging_bytes") == inflight * big["w"].numel() * 4
    assert value(registry, "asyncckpt_inflight_saves") == 0


def test_two_checkpointers_share_one_registry(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    with (
        asyncckpt.AsyncCheckpointer(tmp_path / "a", registry=registry) as a,
        asyncckpt.AsyncCheckpointer(tmp_path / "b", registry=registry) as b,
    ):
        a.save(1, known_state(1))
        b.save(1, known_state(1))
        b.save(2, known_state(2))
    assert value(registry, "asyncckpt_saves_total", result="committed") == 3
    assert value(registry, "asyncckpt_raw_bytes_total") == 3 * KNOWN_RAW_BYTES
    assert value(registry, "asyncckpt_inflight_saves") == 0


def test_sync_equivalent_uses_the_bandwidth_measured_on_that_save() -> None:
    result = SaveResult(step=1, path=None, raw_bytes=1000, stored_bytes=250,
                        stage_seconds={"write": 0.3, "fsync": 0.2})  # fmt: skip
    # 250 bytes took 0.5 s: 500 B/s; 1000 raw bytes at 500 B/s take 2 s.
    assert sync_equivalent_seconds(result) == pytest.approx(2.0)
    assert sync_equivalent_seconds(SaveResult(step=1, path=None)) == 0.0


def test_every_save_result_label_is_exported_from_the_start() -> None:
    registry = CollectorRegistry()
    from asyncckpt.metrics import metrics_for

    metrics_for(registry)
    for result in SAVE_RESULTS:
        assert value(registry, "asyncckpt_saves_total", result=result) == 0
    for stage in STAGES:
        assert value(registry, "asyncckpt_stage_seconds_total", stage=stage) == 0


def test_a_save_staged_through_one_observer_and_finished_through_another_balances() -> None:
    # The DCP integration stages through its stager's observer and reports the write through its writer's.
    from asyncckpt.metrics import PrometheusObserver, metrics_for

    registry = CollectorRegistry()
    stager, writer = PrometheusObserver(metrics_for(registry)), PrometheusObserver(metrics_for(registry))
    stager.save_staged(0.002, 4096, 1)
    stager.save_staged(0.003, 1024, 2)
    assert value(registry, "asyncckpt_staging_bytes") == 5120 and value(registry, "asyncckpt_inflight_saves") == 2
    writer.save_finished(SaveResult(step=1, path=None, raw_bytes=4096, stored_bytes=4096, stall_seconds=0.002,
                                    gpu_idle_seconds=0.002), 1)  # fmt: skip
    assert value(registry, "asyncckpt_staging_bytes") == 1024 and value(registry, "asyncckpt_inflight_saves") == 1
    writer.save_failed(OSError("disk full"), 0)
    assert value(registry, "asyncckpt_staging_bytes") == 0 and value(registry, "asyncckpt_inflight_saves") == 0
    writer.save_failed(OSError("reported twice"), 0)  # an extra report never drives the gauges negative
    assert value(registry, "asyncckpt_staging_bytes") == 0 and value(registry, "asyncckpt_inflight_saves") == 0
    assert value(registry, "asyncckpt_saves_total", result="failed") == 2
    assert value(registry, "asyncckpt_gpu_idle_seconds_total") == pytest.approx(0.005)
