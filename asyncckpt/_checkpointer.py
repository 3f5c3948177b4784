"""The asynchronous checkpointer: snapshot on the training thread, persist on a worker thread.

Threads:

* the **training thread** calls :meth:`AsyncCheckpointer.save`; it validates the state,
  waits for an in-flight slot (backpressure), stages a snapshot and returns a
  :class:`SaveHandle` — no compression, no I/O;
* one **worker thread** (``asyncckpt-worker``) persists snapshots in order through the
  checkpointer's :class:`~asyncckpt._persist.Committer`. It never issues collectives.

Errors from the worker are never swallowed: the handle's ``result()`` raises them, and the
checkpointer raises the first unreported one from the next ``save()``, ``wait()`` or
``close()`` (once). A checkpointer dropped with saves in flight warns; at interpreter exit
in-flight saves are finished (``atexit``) rather than lost.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import threading
import time
import warnings
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

from ._backend import build_backend
from ._handle import SaveHandle
from ._layout import MAX_STEP, checkpoint_name, latest_step
from ._manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from ._persist import Committer, RunDirectory, SaveJob
from ._retention import discard_steps_after, remove_stale_temporaries
from ._tree import flatten
from .errors import CheckpointError, SaveFailedError
from .observer import GuardedObserver, NullObserver, SaveObserver
from .options import resolve_options
from .result import SaveResult

log = logging.getLogger("asyncckpt")

_STOP = object()


class AsyncCheckpointer:
    """Saves training state in the background.

    Args:
        directory: run directory; checkpoints go to ``directory/step-NNNNNNNNNN``.
        observer: receives save events (metrics); default: the Prometheus exporter if
            ``metrics_port`` (or ``ASYNCCKPT_METRICS_PORT``) is set or ``registry`` is given.
        registry: a ``prometheus_client.CollectorRegistry`` to record metrics into.
        preallocate_for: a state like the ones to be saved: its staging memory (pinned host
            blocks, a GPU arena) is allocated in the background from construction, so the first
            save allocates nothing (:meth:`preallocate`).
        **options: any field of :class:`~asyncckpt.options.CheckpointOptions`
            (``keep_last``, ``max_inflight``, ``when_busy``, ``codec``, ``snapshot``, ...).
    """

    def __init__(self, directory: str | os.PathLike[str], *, observer: SaveObserver | None = None,
                 registry: Any = None, preallocate_for: object = None, _committer: Committer | None = None,
                 **options: Any) -> None:  # fmt: skip
        self.options = resolve_options(**options)
        self.directory = Path(directory)
        # `_committer` is internal: the distributed and integration subclasses pass theirs.
        self._committer = _committer if _committer is not None else RunDirectory(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in remove_stale_temporaries(self.directory):
            log.info("asyncckpt: removed %s, left by a process that died mid-save", stale)
        self._observer = GuardedObserver(
            observer if observer is not None else _default_observer(self.options, registry)
        )
        self._backend = build_backend(self.options)
        self._delta = self._backend.delta
        """Incremental saves' reference store (None: ``delta="off"``); the worker's, invalidated on failure."""
        self._slots = threading.BoundedSemaphore(self.options.max_inflight)
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queue_order = threading.Lock()
        """Held from staging a save to queueing its job (see _stage_and_queue)."""
        # Notified when a save() leaves; close() waits on it for saves already past their checks.
        self._left = threading.Condition(self._lock)
        self._entered = 0
        """save() calls past their checks and not yet queued or refused (close() waits for them)."""
        self._reserved: set[int] = set()
        """Steps a save() is staging now, so a concurrent save() of the same step is refused at once."""
        self._inflight: dict[int, SaveHandle] = {}
        self._unreported: SaveFailedError | None = None
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="asyncckpt-worker", daemon=True)
        self._worker.start()
        # Finish in-flight saves at interpreter exit instead of losing them with the daemon thread.
        self._atexit = _close_at_exit(weakref.ref(self))
        _register_exit_hook(self._atexit)
        if preallocate_for is not None:
            self.preallocate(preallocate_for)

    # ------------------------------------------------------------------ training thread
    def save(self, step: int, state: object, *, metadata: dict[str, Any] | None = None,
             full: bool = False) -> SaveHandle:  # fmt: skip
        """Snapshot ``state`` and persist it in the background as checkpoint ``step``.

        ``full``: with the ``delta`` option, store every tensor in full (this save starts a new
        chain); without it, every save is full anyway.

        Returns once the snapshot is staged (``handle.staged``): the caller may then mutate
        its tensors. Blocks only to wait for an in-flight slot (``max_inflight``), and that
        wait counts as stall. Runs on the training thread; no compression or I/O happens here.
        Thread-safe: a save() that returns a handle is always persisted (a concurrent
        :meth:`close` waits for it), and of two concurrent saves of one step the second is
        refused at once.

        Raises:
            TypeError: the state holds an object asyncckpt cannot store (names its key path),
                or ``metadata`` is not JSON-serialisable.
            SaveFailedError: an earlier background save failed (raised once).
            CheckpointError: ``step`` is invalid or already saved; the checkpointer is closed.
        """
        started = time.perf_counter()
        self._check_usable()
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            raise CheckpointError(f"step must be a non-negative int of at most 2**62 (what list_checkpoints() and "
                                  f"load() read back), got {step!r}")  # fmt: skip
        metadata = _checked_metadata(metadata)
        flat = flatten(state)
        self._enter(step)
        try:
            return self._stage_and_queue(step, flat, metadata, started, full)
        finally:
            self._leave(step)

    def _enter(self, step: int) -> None:
        """Claim ``step`` for this save() call, or raise. Training thread (any thread calling save())."""
        with self._lock:
            if self._closed:
                raise CheckpointError("this AsyncCheckpointer is closed")
            if step in self._reserved or step in self._inflight:
                raise CheckpointError(f"step {step} is being saved in {self.directory} (by this or another "
                                      "thread); use a new step number")  # fmt: skip
            if os.path.lexists(self.directory / checkpoint_name(step)):
                raise CheckpointError(_taken_message(self.directory, step))
            self._reserved.add(step)
            self._entered += 1

    def _leave(self, step: int) -> None:
        with self._lock:
            self._reserved.discard(step)
            self._entered -= 1
            self._left.notify_all()

    def _stage_and_queue(self, step: int, flat: Any, metadata: dict[str, Any], started: float,
                         full: bool = False) -> SaveHandle:  # fmt: skip
        if self.options.when_busy == "skip":
            if not self._slots.acquire(blocking=False):
                self._observer.save_skipped()
                handle = SaveHandle(step)
                handle._finish(SaveResult(step=step, path=None, skipped=True))
                return handle
        else:
            self._slots.acquire()
        # Staging hands a GPU snapshot to the compressor, which takes snapshots in that order; the
        # worker must take the jobs in the same order (a delta save's compressor waits for the
        # worker), so concurrent save() calls stage and queue one at a time.
        with self._queue_order:
            try:
                self._raise_unreported()  # a save that failed while we waited for its slot
                began = time.perf_counter()
                snapshot = self._backend.stager.stage(flat)
                staged_at = time.perf_counter()
            except BaseException:
                self._slots.release()
                raise
            stall = staged_at - started
            handle = SaveHandle(step)
            handle.stall_seconds = stall
            snapshot.when_staged(lambda: handle._set_staged(stall))  # a GPU fence: once the GPU has read it
            job = SaveJob(step=step, structure=flat, snapshot=snapshot, metadata=metadata,
                          created_unix=time.time(), started=started, stall_seconds=stall,
                          snapshot_seconds=staged_at - began, snapshot_mode=self._backend.snapshot_mode,
                          snapshot_reason=self._backend.snapshot_reason, full=full)  # fmt: skip
            with self._lock:
                self._inflight[step] = handle
                inflight = len(self._inflight)
            # Report before queueing, so this save's staged event always precedes its finished/failed one.
            self._observer.save_staged(stall, snapshot.staging_bytes, inflight)
            self._jobs.put((job, handle))  # before _leave(): close() queues its stop only after this
        return handle

    def preallocate(self, state: object) -> threading.Thread:
        """Allocate the staging memory a save of ``state`` will need, on a background thread.

        Returns that (started) thread; ``join()`` it to wait. Pinning host memory takes about a
        second per few GB, which a first save would otherwise spend (in ``host`` mode on the
        training thread, in ``fence`` mode while the next optimizer step waits). Call it when no
        save is in flight, e.g. after the first ``optimizer.step()`` has created the moments.
        With ``delta`` on the GPU path it then allocates the memory for the references (after the
        staging, so the reference budget sees what staging took): a first save taken after the
        thread has finished keeps them, and the second is already a delta (without it, the third).
        """
        self._check_usable()
        flat = flatten(state)
        staging = self._backend.stager.preallocate(flat)
        delta = self._delta
        if delta is None:
            return staging

        def then_references() -> None:
            staging.join()
            stager = self._backend.stager  # after the staging: the plan sees what it allocated
            references = delta.reserve(flat.tensors, stager.host_staging_bytes(), stager.delta_limit(flat))
            if references is not None:
                references.join()

        both = threading.Thread(target=then_references, name="asyncckpt-prealloc-all", daemon=True)
        both.start()
        return both

    def wait(self, timeout: float | None = None) -> None:
        """Block until every in-flight save is done; raise the first unreported failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            handles = list(self._inflight.values())
        for handle in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not handle.wait(left):
                raise CheckpointError(f"in-flight saves not finished after {timeout} s")
        self._raise_unreported()

    def close(self) -> None:
        """Finish in-flight saves, stop the worker, and raise the first unreported failure. Idempotent.

        Any thread. A save() running on another thread meanwhile either is persisted before the
        worker stops (it was past its checks) or raises ``CheckpointError`` (closed): no handle
        is left that never completes.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._entered:  # saves past their checks: let them queue their job first
                self._left.wait()
        atexit.unregister(self._atexit)  # no-op when the hook went to threading's exit hooks
        self._jobs.put(_STOP)
        self._worker.join()
        self._backend.close()
        self._raise_unreported()

    def discard_steps_after(self, step: int) -> list[int]:
        """Delete the committed checkpoints above ``step``; returns their steps. Training thread.

        For a job restarted from checkpoint ``step`` (a new timeline): its later checkpoints are
        kept by retention and refuse their step numbers as "already saved" until this removes
        them. Waits for in-flight saves first.
        """
        self.wait()
        if self._delta is not None:
            self._delta.invalidate()  # the reference may be among the discarded steps
        return discard_steps_after(self.directory, step)

    @property
    def observer_errors(self) -> int:
        """How many times an observer hook raised (each is logged; the save itself went on)."""
        return self._observer.errors

    @property
    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        if exc is None:
            self.close()
            return
        try:  # the body already failed: finish saves, but don't mask its exception
            self.close()
        except CheckpointError as error:
            log.error("asyncckpt: a background save failed too: %s", error)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and self.inflight:
            warnings.warn(
                f"AsyncCheckpointer({str(self.directory)!r}) dropped with {self.inflight} save(s) in flight; "
                "call close() or use it as a context manager",
                ResourceWarning,
                stacklevel=1,
            )

    def _check_usable(self) -> None:
        if self._closed:
            raise CheckpointError("this AsyncCheckpointer is closed")
        self._raise_unreported()

    def _raise_unreported(self) -> None:
        with self._lock:
            error, self._unreported = self._unreported, None
        if error is not None:
            raise error

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            job, handle = item
            try:
                result = self._committer.persist(job, self._backend, self.options.keep_last)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread, never swallowed
                error = SaveFailedError(
                    f"saving step {job.step} to {self.directory} failed: {type(exc).__name__}: {exc}. "
                    f"The latest good checkpoint is unchanged."
                )
                error.__cause__ = exc
                _release_quietly(job)  # a save that failed before write_part still holds its staging
                if self._delta is not None:
                    self._delta.invalidate()  # the reference bytes were overwritten for a save that never committed
                with self._lock:
                    self._inflight.pop(job.step, None)
                    if self._unreported is None:
                        self._unreported = error
                    inflight = len(self._inflight)
                self._slots.release()
                log.error("%s", error)
                self._observer.save_failed(exc, inflight)
                handle._fail(error)
                continue
            with self._lock:
                self._inflight.pop(job.step, None)
                inflight = len(self._inflight)
            self._slots.release()
            log.info("asyncckpt: step %d committed: %d -> %d bytes in %.3f s", result.step, result.raw_bytes,
                     result.stored_bytes, result.durable_seconds)  # fmt: skip
            self._observer.save_finished(result, inflight)
            handle._finish(result)


def _taken_message(directory: Path, step: int) -> str:
    """Why ``step`` cannot be saved in ``directory``, whose entry of that name exists, and what to do."""
    path = directory / checkpoint_name(step)
    if path.is_symlink() or not (path / MANIFEST_NAME).is_file():
        return (f"{path} exists but is not a checkpoint (a symlink, or a directory without {MANIFEST_NAME}); "
                "move it away to save this step")  # fmt: skip
    latest = latest_step(directory)
    if latest is not None and latest < step:
        return (f"step {step} is already saved in {directory}, by a run whose checkpoints lie after the latest one "
                f"(step {latest}): this run restarted from an earlier checkpoint. Call discard_steps_after({latest}) "
                "to remove that abandoned timeline, or use a new step number")  # fmt: skip
    return f"step {step} is already saved in {directory}; use a new step number"


def _release_quietly(job: SaveJob) -> None:
    """Return a failed save's staging memory (release() is idempotent), so the next save cannot block on it."""
    try:
        job.snapshot.release()
    except Exception:
        log.exception("asyncckpt: releasing the staging memory of failed step %d failed too", job.step)


def _register_exit_hook(hook: Any) -> None:
    """Run ``hook`` at interpreter exit *before* thread pools refuse new work.

    ``concurrent.futures`` shuts its pools down from ``threading``'s exit hooks, which run before
    ``atexit`` handlers, so a save finished from a plain ``atexit`` handler would fail with "cannot
    schedule new futures after interpreter shutdown". ``threading._register_atexit`` hooks run in
    reverse registration order, and ours is registered after ``concurrent.futures`` was imported,
    so it runs first. ``atexit`` stays as the fallback for Pythons without the private hook.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(hook)
        return
    try:
        register(hook)
    except RuntimeError:  # already shutting down
        atexit.register(hook)


def _close_at_exit(ref: weakref.ReferenceType[AsyncCheckpointer]) -> Any:
    def close() -> None:
        checkpointer = ref()
        if checkpointer is not None and not checkpointer._closed:
            try:
                checkpointer.close()
            except CheckpointError as error:
                log.error("asyncckpt: at exit: %s", error)

    return close


def _checked_metadata(metadata: dict[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    try:
        text = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be JSON-serialisable (no nan/inf): {exc}") from exc
    if len(text) > MAX_MANIFEST_BYTES:
        raise TypeError(f"metadata takes {len(text)} bytes as JSON, more than the {MAX_MANIFEST_BYTES} a manifest "
                        "load() reads may hold; keep large data in the state, as tensors")  # fmt: skip
    return dict(json.loads(text))


def _default_observer(options: Any, registry: Any) -> SaveObserver:
    if options.metrics_port is None and registry is None:
        return NullObserver()
    from .metrics import PrometheusObserver  # prometheus-client is imported only when asked for

    return PrometheusObserver.create(options=options, registry=registry)
