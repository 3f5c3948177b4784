"""An asynchronous checkpointer that saves each checkpoint to a path the framework chooses.

Lightning names checkpoints ``epoch=0-step=10.ckpt`` and ``last.ckpt``; the Hugging Face Trainer
``checkpoint-500``. This wraps :class:`~asyncckpt.AsyncCheckpointer` (same staging, codecs,
worker thread, error reporting and metrics) so that save ``n`` is committed as a directory at
its own path: written beside it under a temporary name, then renamed into place, replacing an
older checkpoint of the same name whole (no ``latest`` pointer, no ``step-*`` names).

Threads: :meth:`save_to`, :meth:`wait_for`, :meth:`close` on the training thread; the commit on
the checkpointer's worker thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._checkpointer import AsyncCheckpointer
from .._data_path import Backend
from .._handle import SaveHandle
from .._persist import SaveJob, check_extra_files, persist_to
from .._retention import delete_checkpoint_dir
from ..errors import CheckpointError
from ..result import SaveResult

log = logging.getLogger("asyncckpt")


class TargetPaths:
    """The :class:`~asyncckpt._persist.Committer` of a :class:`TargetedCheckpointer`: save number ``n``
    goes to the path :meth:`assign` gave it, replacing an older checkpoint there whole.

    :meth:`assign` and :meth:`numbers_for` on the training thread, :meth:`persist` on the worker.
    """

    def __init__(self) -> None:
        self._targets: dict[int, tuple[Path, dict[str, bytes]]] = {}
        self._lock = threading.Lock()

    def assign(self, number: int, target: Path, files: dict[str, bytes]) -> None:
        with self._lock:
            self._targets[number] = (target, files)

    def forget(self, number: int) -> None:
        with self._lock:
            self._targets.pop(number, None)

    def numbers_for(self, target: Path) -> list[int]:
        """The save numbers going to ``target`` that are not yet committed or failed."""
        with self._lock:
            return [n for n, (p, _) in self._targets.items() if p == target]

    def persist(self, job: SaveJob, backend: Backend, keep_last: int | None) -> SaveResult:
        with self._lock:
            target, files = self._targets[job.step]
        job.files = files
        try:
            return persist_to(job, target, backend.encoder, backend.storage, point_latest=False, replace=True)
        finally:  # only now: wait_for() must see this save until it is committed or failed
            self.forget(job.step)


class TargetedCheckpointer(AsyncCheckpointer):
    """:class:`~asyncckpt.AsyncCheckpointer` whose saves go to explicit paths (see module docstring).

    The ``step`` of each manifest is a per-process save counter (the framework's own step goes in
    ``metadata``), so two saves at one training step (``last.ckpt`` and ``epoch=..ckpt``) never clash.
    """

    def __init__(self, directory: str | os.PathLike[str], **kwargs: Any) -> None:
        if kwargs.get("delta", "off") != "off":
            raise CheckpointError(
                f"delta={kwargs['delta']!r}: the Lightning and Hugging Face integrations write each checkpoint to a "
                "path of its own, which the framework may delete or replace, so no checkpoint can be another's base; "
                "they always write full checkpoints. Drop the delta option"
            )
        self._targets = TargetPaths()
        self._counter = itertools.count(1)
        # Explicitly off, so an ASYNCCKPT_DELTA set for the whole job does not apply here either.
        super().__init__(directory, _committer=self._targets, **{**kwargs, "delta": "off"})

    def save_to(self, path: str | os.PathLike[str], state: object, *, metadata: dict[str, Any] | None = None,
                files: dict[str, bytes] | None = None) -> SaveHandle:  # fmt: skip
        """Snapshot ``state`` now; commit it as the directory ``path`` in the background. Training thread.

        ``files``: small extra files (name -> bytes) committed inside the same directory, atomically
        with the tensors (e.g. the Trainer's ``trainer_state.json``).
        """
        target = Path(path).absolute()
        extra = check_extra_files(files)
        target.parent.mkdir(parents=True, exist_ok=True)
        number = next(self._counter)
        self._targets.assign(number, target, extra)
        try:
            handle = self.save(number, state, metadata=metadata)
        except BaseException:
            self._targets.forget(number)
            raise
        if handle.done():  # skipped (when_busy="skip") or already over: nothing will commit this number now
            self._targets.forget(number)
        return handle

    def wait_for(self, path: str | os.PathLike[str]) -> None:
        """Wait until no save to ``path`` is in flight (raises the first unreported failure)."""
        numbers = self._targets.numbers_for(Path(path).absolute())
        with self._lock:
            handles = [self._inflight[n] for n in numbers if n in self._inflight]
        for handle in handles:
            handle.wait()
        self._raise_unreported()


def remove_checkpoint_dir(path: str | os.PathLike[str]) -> None:
    """Delete a checkpoint directory (renamed aside first, so it never looks half-deleted) or file."""
    target = Path(path)
    if target.is_dir() and not target.is_symlink():
        delete_checkpoint_dir(target)
    else:
        with contextlib.suppress(FileNotFoundError):
            target.unlink()


def preallocate_or_warn(start: Callable[[], threading.Thread]) -> threading.Thread | None:
    """The integrations' staging ahead of the first save: ``start()``'s allocation thread, or None with
    a warning when it could not be started (the first save then allocates, and reports what is
    wrong). Training thread."""
    try:
        return start()
    except Exception as exc:  # noqa: BLE001 - the first save allocates instead, and reports what is wrong
        log.warning("asyncckpt: could not allocate the checkpoint staging ahead of the first save "
                    "(that save will allocate it): %s", exc)  # fmt: skip
        return None
