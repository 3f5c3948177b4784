"""The storage plug-in interface: append blobs to a data file, read them back.

Offsets are multiples of :data:`ALIGNMENT` so the same files work with O_DIRECT and
GPUDirect Storage, whose transfers want 4 KiB-aligned file offsets. Buffers are 1-D
``torch.uint8`` tensors in host or device memory, as the codecs produce them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

ALIGNMENT = 4096
"""File offset alignment of every blob, in bytes."""


def align_up(offset: int, alignment: int = ALIGNMENT) -> int:
    return (offset + alignment - 1) // alignment * alignment


class BlobWriter(Protocol):
    """Writes one data file; used by one worker thread."""

    def append(self, data: torch.Tensor) -> int:
        """Queue ``data`` for writing at the next aligned offset and return that offset.

        The writer keeps a reference to ``data`` until it is written (writes may be queued);
        the caller must not modify it until :meth:`sync` returns.
        """
        ...

    def sync(self) -> int:
        """Wait for every queued write, then flush the file to stable storage (fsync).

        Returns the file's size in bytes.
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
