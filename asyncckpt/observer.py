"""What the checkpointer reports as it works, for metrics and logs.

The checkpointer calls these hooks; :mod:`asyncckpt.metrics` implements them for Prometheus.
``save_staged``/``save_skipped`` run on the training thread; the others on the worker thread.
``save_staged`` is called before the save is queued, so it always precedes that save's
``save_finished``/``save_failed``. :func:`asyncckpt.load` is not tied to a checkpointer: it
reports to the process-wide load listeners (:func:`add_load_listener`), on the loading thread.
Hooks and listeners must be cheap and should not raise; the checkpointer calls its hooks
through :class:`GuardedObserver`, so one that raises is logged and counted, and the save goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from .result import SaveResult

log = logging.getLogger("asyncckpt")


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


class GuardedObserver:
    """Calls another observer's hooks; a hook that raises is logged and counted, never propagated.

    A raising hook must not fail a save that succeeded, nor stop the worker thread (whose handles
    would then never complete). Any thread (each hook runs on the thread the protocol names).
    """

    def __init__(self, inner: SaveObserver) -> None:
        self.inner = inner
        self.errors = 0
        """Hook calls that raised, since construction."""
        self._lock = threading.Lock()

    def _call(self, hook: str, *args: Any) -> None:
        try:
            getattr(self.inner, hook)(*args)
        except Exception:
            with self._lock:
                self.errors += 1
            log.exception("asyncckpt: observer hook %s.%s raised; ignored (the save goes on)",
                          type(self.inner).__name__, hook)  # fmt: skip

    def save_staged(self, stall_seconds: float, staging_bytes: int, inflight: int) -> None:
        self._call("save_staged", stall_seconds, staging_bytes, inflight)

    def save_skipped(self) -> None:
        self._call("save_skipped")

    def save_finished(self, result: SaveResult, inflight: int) -> None:
        self._call("save_finished", result, inflight)

    def save_failed(self, error: BaseException, inflight: int) -> None:
        self._call("save_failed", error, inflight)


LoadListener = Callable[[float], None]
"""Called with the seconds one successful :func:`asyncckpt.load` took."""

_load_listeners: list[LoadListener] = []


def add_load_listener(listener: LoadListener) -> None:
    """Call ``listener(seconds)`` after every successful load in this process (any thread)."""
    if listener not in _load_listeners:
        _load_listeners.append(listener)


def remove_load_listener(listener: LoadListener) -> None:
    if listener in _load_listeners:
        _load_listeners.remove(listener)


def notify_load_finished(seconds: float) -> None:
    """Report a finished load; called by the loader on the loading thread."""
    for listener in tuple(_load_listeners):
        listener(seconds)
