"""POSIX file I/O from host memory: ``pwrite``/``pread`` and ``fsync``.

The CPU path's storage, and the fallback wherever KvikIO cannot run (KvikIO needs libcuda
even for host buffers). Writes run on the calling (worker) thread; ``os.pwrite`` releases
the GIL, so the training thread keeps running while the disk works.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import CorruptCheckpointError
from .base import align_up


class PosixBlobWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        # O_EXCL: a data file is written once, into a fresh temporary directory.
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self._end = 0

    def append(self, data: torch.Tensor) -> int:
        assert self._fd is not None, "writer is closed"
        if data.device.type != "cpu":
            data = data.cpu()
        offset = align_up(self._end)
        view = data.numpy().data.cast("B")
        written = 0
        while written < len(view):
            written += os.pwrite(self._fd, view[written:], offset + written)
        self._end = offset + len(view)
        return offset

    def sync(self) -> int:
        assert self._fd is not None, "writer is closed"
        os.fsync(self._fd)
        return self._end

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class PosixBlobReader:
    def __init__(self, path: Path) -> None:
        self.path = path
        # O_NOFOLLOW: a data file that is a symlink could point outside the checkpoint.
        self._fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)

    def read(self, offset: int, size: int) -> torch.Tensor:
        assert self._fd is not None, "reader is closed"
        out = torch.empty(size, dtype=torch.uint8)
        view = out.numpy().data.cast("B")
        done = 0
        while done < size:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise CorruptCheckpointError(
                    f"{self.path}: file ends at byte {offset + done}, expected {offset + size}"
                )
            done += got
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
