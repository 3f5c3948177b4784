"""POSIX file I/O from host memory: ``pwrite``/``pread`` and ``fsync``.

The CPU path's storage, and the fallback wherever KvikIO cannot run (KvikIO needs libcuda
even for host buffers). Writes run on the calling (worker) thread; ``os.pwrite`` releases
the GIL, so the training thread keeps running while the disk works.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from .base import StickyFailure, align_up


def create_for_writing(path: Path) -> int:
    """A write-only descriptor of a new file; O_EXCL: a data file is written once, into a fresh temporary directory."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)


def pwrite_fully(fd: int, buffer: Any, offset: int) -> None:
    """``pwrite`` all of ``buffer`` (any readable buffer) at ``offset``; a short write is retried, an error raised."""
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        written = os.pwrite(fd, view[done:], offset + done)
        if written == 0:  # never for a regular file; a loop that cannot progress must not spin
            raise OSError(f"pwrite wrote nothing at offset {offset + done}")
        done += written


class PosixBlobWriter:
    """Writes each blob on the calling thread; a failed write is raised again by every later call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = create_for_writing(path)
        self._end = 0
        self._failure = StickyFailure()

    def append(self, data: torch.Tensor) -> int:
        assert self._fd is not None, "writer is closed"
        if (failure := self._failure.again()) is not None:
            raise failure  # a caller that caught it must not write on into a file with a hole
        if data.device.type != "cpu":
            data = data.cpu()
        offset = align_up(self._end)
        view = data.numpy().data.cast("B")
        try:
            pwrite_fully(self._fd, view, offset)
        except OSError as exc:
            self._failure.record(exc)
            raise
        self._end = offset + len(view)
        return offset

    def sync(self) -> int:
        assert self._fd is not None, "writer is closed"
        if (failure := self._failure.again()) is not None:
            raise failure  # nor sync that file as if whole
        os.fsync(self._fd)
        return self._end

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_for_reading(path: Path) -> int:
    """A read-only descriptor; O_NOFOLLOW: a data file that is a symlink could point outside the checkpoint."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)


def pread_fully(fd: int, buffer: Any, offset: int) -> int:
    """``pread`` into ``buffer`` (any writable buffer) until it is full or the file ends; returns the bytes read."""
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


class PosixBlobReader:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = open_for_reading(path)

    def read(self, offset: int, size: int) -> torch.Tensor:
        assert self._fd is not None, "reader is closed"
        out = torch.empty(size, dtype=torch.uint8)
        try:
            done = pread_fully(self._fd, out.numpy(), offset)
        except OSError as exc:  # EIO from a failing disk: a read error of this file at this offset
            raise CorruptCheckpointError(
                f"{self.path}: cannot read {size} bytes at offset {offset}: {exc}; the storage under it failed"
            ) from exc
        if done < size:
            raise CorruptCheckpointError(f"{self.path}: file ends at byte {offset + done}, expected {offset + size}")
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class PosixStorage:
    """Host-memory storage through POSIX calls."""

    io_mode = "posix"

    def open_writer(self, path: Path) -> PosixBlobWriter:
        return PosixBlobWriter(path)

    def open_reader(self, path: Path) -> PosixBlobReader:
        return PosixBlobReader(path)
