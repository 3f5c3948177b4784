"""Prometheus metrics: the metric families, and the observer that feeds them from the checkpointer.

Opt-in: this module (and prometheus_client) is imported only when a checkpointer gets
``metrics_port`` (or ``ASYNCCKPT_METRICS_PORT``) or ``registry=``; ``import asyncckpt``
serves nothing. Names carry the ``asyncckpt_`` prefix and base units (seconds, bytes;
``_total`` on counters); this is the one module that converts. No label carries a step, a
path or a tensor name, so the series count is fixed. docs/metrics.md lists every metric and
defines the derived ones:

* **GPU idle seconds** of a save = host seconds the training thread was blocked in
  ``save()`` (``SaveResult.stall_seconds``) + GPU seconds the snapshot copy and fence waits
  took from the training stream, measured with CUDA events (``SaveResult.gpu_idle_seconds``
  holds the sum). A failed save's stall is counted too: the GPU waited all the same.
* **synchronous equivalent** of a committed save = the seconds writing its *raw* bytes
  would have blocked training at the write bandwidth measured on that very save:
  ``raw_bytes / (stored_bytes / (write + fsync seconds))``.
* **avoided** = ``max(0, synchronous equivalent - GPU idle seconds)``, per save.

Threads: ``save_staged``/``save_skipped`` run on the training thread, ``save_finished``/
``save_failed`` on the checkpoint worker thread, the load hook on the thread that called
:func:`asyncckpt.load`. prometheus_client metrics are thread-safe; the staging FIFO has a lock.
"""

from __future__ import annotations

import collections
import functools
import importlib.metadata
import threading
import time
import weakref
from typing import Any

import prometheus_client
import torch
from prometheus_client import Counter, Gauge, Histogram

from ._version import __version__
from .metrics_exporter import start_exporter
from .observer import add_load_listener
from .options import CheckpointOptions
from .result import STAGES, SaveResult

__all__ = ["SAVE_RESULTS", "STALL_BUCKETS_SECONDS", "Metrics", "PrometheusObserver", "metrics_for",
           "sync_equivalent_seconds"]  # fmt: skip

STALL_BUCKETS_SECONDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
"""100 us (a host snapshot of a small model) to 10 min (a blocking wait behind a slow disk)."""

SAVE_RESULTS = ("committed", "failed", "skipped")

_UNKNOWN = "unknown"


class Metrics:
    """asyncckpt's metric families in one registry. Created once per registry (:func:`metrics_for`)."""

    def __init__(self, registry: Any) -> None:
        r = registry
        self.stall = Histogram(
            "asyncckpt_save_stall_seconds",
            "Host seconds the training thread was blocked in save() (slot wait + snapshot), per staged save",
            buckets=STALL_BUCKETS_SECONDS, registry=r,
        )  # fmt: skip
        self.gpu_idle = Counter(
            "asyncckpt_gpu_idle_seconds_total",
            "GPU seconds checkpointing kept from training: save() stall + measured GPU snapshot-copy and fence time",
            registry=r,
        )
        self.sync_equivalent = Counter(
            "asyncckpt_gpu_idle_sync_equivalent_seconds_total",
            "GPU idle seconds a synchronous save of the same raw bytes would have cost, at the write+fsync "
            "bandwidth measured on each committed save",
            registry=r,
        )
        self.avoided = Counter(
            "asyncckpt_gpu_idle_avoided_seconds_total",
            "Per committed save, max(0, synchronous equivalent - GPU idle seconds): GPU time async saving gave back",
            registry=r,
        )
        self.raw_bytes = Counter(
            "asyncckpt_raw_bytes_total", "Tensor bytes of committed saves, uncompressed", registry=r
        )
        self.stored_bytes = Counter(
            "asyncckpt_stored_bytes_total", "Tensor bytes committed saves wrote, after compression", registry=r
        )
        self.saved_bytes = Counter(
            "asyncckpt_compression_saved_bytes_total",
            "Bytes compression kept off storage: raw - stored, per committed save",
            registry=r,
        )
        self.stage_seconds = Counter(
            "asyncckpt_stage_seconds_total",
            "Seconds committed saves spent per stage (snapshot, compress, write, fsync, commit)",
            ["stage"], registry=r,
        )  # fmt: skip
        self.saves = Counter(
            "asyncckpt_saves_total", "Saves by result: committed, failed, skipped (no free slot)", ["result"],
            registry=r,
        )  # fmt: skip
        self.inflight = Gauge(
            "asyncckpt_inflight_saves", "Saves staged and not yet committed or failed",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.staging_bytes = Gauge(
            "asyncckpt_staging_bytes", "Staging memory held by in-flight snapshots",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.last_success = Gauge(
            "asyncckpt_last_success_timestamp_seconds",
            "Unix time the latest committed save became durable; 0 before the first",
            registry=r, multiprocess_mode="max",
        )  # fmt: skip
        self.load_seconds = Histogram(
            "asyncckpt_load_seconds", "Seconds asyncckpt.load() took, per successful load",
            buckets=STALL_BUCKETS_SECONDS, registry=r,
        )  # fmt: skip
        self.build_info = Gauge(
            "asyncckpt_build_info",
            "Always 1. Labels: versions of asyncckpt, torch, nvCOMP, KvikIO; the configured codec; how the latest "
            "committed save reached storage (io_mode posix, gds or compat) and was snapshotted",
            ["version", "torch", "nvcomp", "kvikio", "codec", "io_mode", "snapshot_mode"],
            registry=r, multiprocess_mode="max",
        )  # fmt: skip
        # Every label value exists from the start, so "0 failures" is a series, not an absence.
        for result in SAVE_RESULTS:
            self.saves.labels(result=result)
        for stage in STAGES:
            self.stage_seconds.labels(stage=stage)
        self._info_lock = threading.Lock()
        self._info: dict[str, str] | None = None
        # Staging bytes of in-flight saves, oldest first, shared by every observer of this registry:
        # a save may be staged through one observer and finished through another (the DCP
        # integration's stager and writer). A checkpointer's one worker finishes saves in the order
        # they were staged, and save_staged runs before the save is queued, so the oldest entry is
        # the save being retired. (Several checkpointers saving at once may swap entries between
        # them for a moment; the gauge is exact again whenever no save is in flight.)
        self._staging_lock = threading.Lock()
        self._staging: collections.deque[int] = collections.deque()

    def stage(self, staging_bytes: int) -> None:
        """A save was staged: count it in flight with its staging memory."""
        with self._staging_lock:
            self._staging.append(staging_bytes)
        self.staging_bytes.inc(staging_bytes)
        self.inflight.inc()

    def retire(self) -> None:
        """The oldest in-flight save committed or failed: its staging memory is released."""
        with self._staging_lock:
            if not self._staging:
                return  # finished without a staged event (an integration reporting only the write)
            staging = self._staging.popleft()
        self.staging_bytes.dec(staging)
        self.inflight.dec()

    def set_build_info(self, codec: str, io_mode: str = _UNKNOWN, snapshot_mode: str = _UNKNOWN) -> None:
        """Replace the build-info series (one at a time). ``unknown`` modes never replace known ones."""
        with self._info_lock:
            if self._info is not None and io_mode == _UNKNOWN:
                return
            info = {"version": __version__, "torch": torch.__version__, "nvcomp": _dist_version("nvidia-nvcomp"),
                    "kvikio": _dist_version("kvikio"), "codec": codec, "io_mode": io_mode,
                    "snapshot_mode": snapshot_mode}  # fmt: skip
            if info == self._info:
                return
            if self._info is not None:
                self.build_info.remove(*self._info.values())
            self.build_info.labels(**info).set(1)
            self._info = info

    def observe_load(self, seconds: float) -> None:
        self.load_seconds.observe(seconds)


_metrics_lock = threading.Lock()
_metrics: weakref.WeakKeyDictionary[Any, Metrics] = weakref.WeakKeyDictionary()


def metrics_for(registry: Any = None) -> Metrics:
    """The asyncckpt metrics in ``registry`` (default: prometheus_client's global one), created once."""
    registry = prometheus_client.REGISTRY if registry is None else registry
    with _metrics_lock:
        metrics = _metrics.get(registry)
        if metrics is None:
            metrics = _metrics[registry] = Metrics(registry)
            if len(_metrics) == 1:
                add_load_listener(_record_load)
        return metrics


def _record_load(seconds: float) -> None:
    """Load listener (any thread): every registry with asyncckpt metrics records the load."""
    with _metrics_lock:
        live = list(_metrics.values())
    for metrics in live:
        metrics.observe_load(seconds)


def sync_equivalent_seconds(result: SaveResult) -> float:
    """Seconds a synchronous save of ``result``'s raw bytes would have blocked, at its measured bandwidth.

    The bandwidth is ``stored_bytes / (write + fsync seconds)`` of this save (write alone
    understates it: writes may be queued until fsync). 0.0 when nothing was written.
    """
    io_seconds = result.stage_seconds.get("write", 0.0) + result.stage_seconds.get("fsync", 0.0)
    if result.stored_bytes <= 0 or io_seconds <= 0.0:
        return 0.0
    return result.raw_bytes * io_seconds / result.stored_bytes


class PrometheusObserver:
    """A :class:`~asyncckpt.observer.SaveObserver` that records into :class:`Metrics`.

    One per checkpointer; several may share one registry's metrics (counters add up, gauges
    move by increments, so they stay right with any number of checkpointers). Ignores the
    ``inflight`` argument of the hooks: a count taken on another thread can be stale by the
    time it arrives, an increment cannot.
    """

    def __init__(self, metrics: Metrics, codec: str = "auto") -> None:
        self.metrics = metrics
        self._codec = codec
        metrics.set_build_info(codec)

    @classmethod
    def create(cls, *, options: CheckpointOptions, registry: Any = None) -> PrometheusObserver:
        """Record into ``registry`` (default: the global one); serve it if ``options.metrics_port`` is set.

        Raises:
            CheckpointError: the metrics port is in use (see :func:`~asyncckpt.metrics_exporter.start_exporter`).
        """
        metrics = metrics_for(registry)
        if options.metrics_port is not None:
            start_exporter(options.metrics_port, registry=registry)
        return cls(metrics, codec=options.codec)

    # Training thread.
    def save_staged(self, stall_seconds: float, staging_bytes: int, inflight: int) -> None:
        m = self.metrics
        m.stall.observe(stall_seconds)
        m.gpu_idle.inc(max(0.0, stall_seconds))
        m.stage(staging_bytes)

    def save_skipped(self) -> None:
        self.metrics.saves.labels(result="skipped").inc()

    # Worker thread.
    def save_finished(self, result: SaveResult, inflight: int) -> None:
        m = self.metrics
        m.retire()
        m.saves.labels(result="committed").inc()
        # The stall part was counted in save_staged; add the GPU time measured since.
        m.gpu_idle.inc(max(0.0, result.gpu_idle_seconds - result.stall_seconds))
        equivalent = sync_equivalent_seconds(result)
        m.sync_equivalent.inc(equivalent)
        m.avoided.inc(max(0.0, equivalent - max(result.gpu_idle_seconds, result.stall_seconds)))
        m.raw_bytes.inc(result.raw_bytes)
        m.stored_bytes.inc(result.stored_bytes)
        m.saved_bytes.inc(max(0, result.raw_bytes - result.stored_bytes))
        for stage in STAGES:
            m.stage_seconds.labels(stage=stage).inc(max(0.0, result.stage_seconds.get(stage, 0.0)))
        m.last_success.set(time.time())
        m.set_build_info(self._codec, io_mode=result.io_mode, snapshot_mode=result.snapshot_mode)

    def save_failed(self, error: BaseException, inflight: int) -> None:
        self.metrics.retire()
        self.metrics.saves.labels(result="failed").inc()


@functools.cache
def _dist_version(prefix: str) -> str:
    """Version of the installed distribution ``prefix``, ``prefix-cu12`` or ``prefix-cu13``; ``none`` if absent."""
    for name in (prefix, f"{prefix}-cu12", f"{prefix}-cu13"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"
