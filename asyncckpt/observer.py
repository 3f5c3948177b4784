"""What the checkpointer reports as it works, for metrics and logs.

The checkpointer calls these hooks; :mod:`asyncckpt.metrics` implements them for Prometheus.
``save_started``/``save_skipped`` run on the training thread; the others on the worker thread
(except ``load_finished``, on the loading thread). Hooks must be cheap and must not raise.
"""

from __future__ import annotations

from typing import Protocol

from .result import SaveResult


class SaveObserver(Protocol):
    def save_staged(self, stall_seconds: float, staging_bytes: int, inflight: int) -> None: ...

    def save_skipped(self) -> None: ...

    def save_finished(self, result: SaveResult, inflight: int) -> None: ...

    def save_failed(self, error: BaseException, inflight: int) -> None: ...


class NullObserver:
    """Observes nothing (metrics off)."""

    def save_staged(self, stall_seconds: float, staging_bytes: int, inflight: int) -> None:
        pass

    def save_skipped(self) -> None:
        pass

    def save_finished(self, result: SaveResult, inflight: int) -> None:
        pass

    def save_failed(self, error: BaseException, inflight: int) -> None:
        pass
