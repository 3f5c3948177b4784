"""Safe, durable file operations on checkpoint paths. Imports nothing else of the package.

Durable: a file or directory entry is fsynced before the call returns. Safe: a read never
follows a symlink, blocks on a FIFO or reads more than its limit. Calling thread.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Create ``path`` (never overwrite) holding ``data``, fsynced before this returns."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_regular_file(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path``, which must be a regular file and not a symlink.

    A FIFO would block a reader forever and a symlink to /dev/zero would fill its memory; a
    symlink could also point outside the checkpoint. Raises OSError (FileNotFoundError if absent).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
