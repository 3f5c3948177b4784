"""The storage plug-in interface: append blobs to a data file, read them back.

Offsets are multiples of :data:`ALIGNMENT` so the same files work with O_DIRECT and
GPUDirect Storage, whose transfers want 4 KiB-aligned file offsets. Buffers are 1-D
``torch.uint8`` tensors in host or device memory, as the codecs produce them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Protocol

import torch

from .._alignment import align_up as alignment_align_up

ALIGNMENT = 4096
"""File offset alignment of every blob, in bytes."""


def align_up(offset: int, alignment: int = ALIGNMENT) -> int:
    """The next blob offset at or after ``offset`` (4 KiB-aligned by default)."""
    return alignment_align_up(offset, alignment)


class StickyFailure:
    """The first failure of a writer, for every later call of it to raise again.

    A writer that failed has a hole in its file: a caller that caught the error must not go on
    and sync it as if whole. Raised with its original traceback, which therefore does not grow
    by a frame per raise.
    """

    def __init__(self) -> None:
        self._failure: tuple[BaseException, TracebackType | None] | None = None

    def record(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = (exc, exc.__traceback__)

    def again(self) -> BaseException | None:
        """The failure, with its original traceback, for the caller to raise (adding one frame, its own)."""
        if self._failure is None:
            return None
        exc, traceback = self._failure
        return exc.with_traceback(traceback)


class InflightWrites:
    """Writes started but not yet waited for, oldest first, bounded in bytes; used by one thread.

    Each write is a ``wait`` callable that returns once it is done and raises if it failed (and
    keeps its buffer alive until then). :meth:`add` waits for the oldest writes while more than
    ``limit_bytes`` are queued, always leaving the newest one running, so the memory held by
    queued buffers stays bounded.

    A failure is sticky: once a wait has raised, :meth:`add`, :meth:`wait_all` and
    :meth:`raise_if_failed` raise it again, so a file with a hole in it is never synced as if
    whole, even by a caller that caught the first error.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._queue: deque[tuple[Callable[[], object], int]] = deque()
        self._bytes = 0
        self._failure = StickyFailure()

    def raise_if_failed(self) -> None:
        """Raise the failure of an earlier write again (a writer calls it before starting another)."""
        if (failure := self._failure.again()) is not None:
            raise failure

    def add(self, wait: Callable[[], object], size: int) -> None:
        self.raise_if_failed()
        self._queue.append((wait, size))
        self._bytes += size
        while self._bytes > self.limit_bytes and len(self._queue) > 1:
            self._wait_oldest()

    def wait_all(self) -> None:
        """Wait for every queued write in order; the first failure is raised (later ones stay queued)."""
        self.raise_if_failed()
        while self._queue:
            self._wait_oldest()

    def discard(self) -> list[Callable[[], object]]:
        """Forget every queued write; returns their waits, oldest first (for a writer that closes after a failure)."""
        waits = [wait for wait, _size in self._queue]
        self._queue.clear()
        self._bytes = 0
        return waits

    def _wait_oldest(self) -> None:
        wait, size = self._queue.popleft()
        self._bytes -= size
        try:
            wait()
        except BaseException as exc:
            self._failure.record(exc)
            raise


class BlobWriter(Protocol):
    """Writes one data file; used by one worker thread."""

    def append(self, data: torch.Tensor) -> int:
        """Queue ``data`` for writing at the next aligned offset and return that offset.

        The writer keeps a reference to ``data`` until it is written (writes may be queued);
        the caller must not modify it until :meth:`sync` returns. Device memory must already
        hold its bytes (the stream that produced them synchronised): writers read it from their
        own threads and streams, ordered after no stream of the caller's (cuFile's DMA cannot
        be). After a failed write, every later ``append`` and ``sync`` raises that failure.
        """
        ...

    def sync(self) -> int:
        """Wait for every queued write, then flush the file to stable storage (fsync).

        Returns the file's size in bytes. Raises the first failed write, every time it is called.
        """
        ...

    def close(self) -> None:
        """Release the file; safe to call after a failure, and more than once."""
        ...


class BlobReader(Protocol):
    """Reads blobs from one data file."""

    def read(self, offset: int, size: int) -> torch.Tensor:
        """Return ``size`` bytes at ``offset`` as a 1-D uint8 tensor (host or device)."""
        ...

    def close(self) -> None: ...


class Storage(Protocol):
    """A way of moving blobs between memory and files."""

    io_mode: str
    """What actually moves the bytes: ``"posix"``, ``"gds"`` or ``"compat"`` (KvikIO bounce buffers)."""

    def open_writer(self, path: Path) -> BlobWriter: ...

    def open_reader(self, path: Path) -> BlobReader: ...
