"""The handle ``save()`` returns: staged now, committed later."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from .errors import CheckpointError
from .result import SaveResult


class SaveHandle:
    """One save in flight. Thread-safe; every method may be called from any thread.

    ``staged`` is True once the caller may mutate the saved tensors (for host and device
    snapshots, already when ``save()`` returns). ``done()``/``wait()``/``result()`` follow the
    background write; ``result()`` raises :class:`~asyncckpt.SaveFailedError` if it failed.
    """

    def __init__(self, step: int) -> None:
        self.step = step
        self.stall_seconds = 0.0
        """Host seconds the training thread spent in save() (slot wait + snapshot)."""
        self._staged = threading.Event()
        self._future: Future[SaveResult] = Future()

    @property
    def staged(self) -> bool:
        """True when the state may be mutated without affecting this checkpoint."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        return self._staged.wait(timeout)

    def done(self) -> bool:
        """True once the save committed, failed or was skipped."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (or ``timeout`` seconds); returns ``done()``. Never raises the save's error."""
        try:
            self._future.exception(timeout)
        except FutureTimeout:
            return False
        return True

    def result(self, timeout: float | None = None) -> SaveResult:
        """The committed checkpoint's :class:`SaveResult`; raises the background error if the save failed."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise CheckpointError(f"save of step {self.step} not finished after {timeout} s") from None

    def __repr__(self) -> str:
        state = "done" if self.done() else ("staged" if self.staged else "staging")
        return f"<SaveHandle step={self.step} {state}>"

    # Called by the checkpointer only.
    def _set_staged(self, stall_seconds: float) -> None:
        self.stall_seconds = stall_seconds
        self._staged.set()

    def _finish(self, result: SaveResult) -> None:
        self._staged.set()
        self._future.set_result(result)

    def _fail(self, error: BaseException) -> None:
        self._staged.set()
        self._future.set_exception(error)
