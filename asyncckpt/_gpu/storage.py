"""GPU storage: writes and reads straight from and into GPU memory.

With GPUDirect Storage (a ``nvidia-fs`` driver and a supporting file system), KvikIO DMAs
between GPU memory and the disk, in parallel over its thread pool. Without it the I/O is
*compat* mode: POSIX through pinned bounce buffers, done by :mod:`asyncckpt._gpu.pinned_io`
(one thread per file; KvikIO's own compat pool with ``ASYNCCKPT_COMPAT_IO=kvikio``, which
slowed training more on the H200: that module says by how much). :attr:`KvikioStorage.io_mode`
says which one runs (``"gds"`` or ``"compat"``); it lands in the manifest and in every
``SaveResult``, and is logged once when the storage is built.

Every blob starts at a 4 KiB-aligned file offset (what GDS needs for DMA). ``pwrite`` returns
a future; the writer keeps each buffer alive until its future completes and bounds the bytes
in flight, so GPU memory held by queued writes stays bounded. ``sync()`` waits for every
write, then ``fsync``\\s the file before the checkpoint may commit.

Threads: a writer or reader is used by one thread (the checkpoint worker, or the loading
thread); KvikIO's own thread pool does the I/O.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from .._storage import BlobWriter, InflightWrites, align_up
from ..errors import CorruptCheckpointError
from .deps import kvikio
from .pinned_io import PinnedPosixReader, PinnedPosixWriter

log = logging.getLogger("asyncckpt")

DEFAULT_IO_THREADS = 16
DEFAULT_TASK_BYTES = 16 << 20
"""KvikIO task size (its default is 4 MiB); equal to KvikIO's default bounce buffer."""
DEFAULT_INFLIGHT_BYTES = 1 << 30
"""Bytes queued to KvikIO beyond which ``append`` waits for the oldest write."""


def configure_threads(io_threads: int) -> int:
    """Set KvikIO's thread pool size: ``io_threads`` if > 0, else ``KVIKIO_NTHREADS`` if set, else 16.

    Also raises KvikIO's task size to :data:`DEFAULT_TASK_BYTES` unless ``KVIKIO_TASK_SIZE`` is
    set: in compat mode every task is a device-to-host copy plus a stream synchronisation by a
    pool thread, CUDA driver calls that contend with the training thread's kernel launches, so
    fewer, larger tasks cost training less (1 GiB in flight still makes 64 tasks for the pool).
    """
    kv = kvikio()
    if io_threads > 0:
        kv.defaults.set("num_threads", io_threads)
    elif not os.environ.get("KVIKIO_NTHREADS"):
        kv.defaults.set("num_threads", min(DEFAULT_IO_THREADS, max(4, os.cpu_count() or 4)))
    if not os.environ.get("KVIKIO_TASK_SIZE"):
        try:
            kv.defaults.set("task_size", DEFAULT_TASK_BYTES)
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:  # an older KvikIO: keep its default
            log.debug("asyncckpt: KvikIO task size left at its default: %s", exc)
    return int(kv.defaults.get("num_threads"))


def io_mode() -> str:
    """``"gds"`` when KvikIO will use GPUDirect Storage, ``"compat"`` when it falls back to POSIX."""
    return "compat" if kvikio().defaults.is_compat_mode_preferred() else "gds"


def _buffer(data: torch.Tensor) -> Any:
    # KvikIO takes device memory through __cuda_array_interface__ and host memory through numpy.
    return data if data.is_cuda else data.numpy()


class KvikioBlobWriter:
    def __init__(self, path: Path, inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> None:
        self.path = path
        self._file: Any = kvikio().CuFile(path, "w")
        self._writes = InflightWrites(inflight_bytes)
        self._end = 0

    def append(self, data: torch.Tensor) -> int:
        assert self._file is not None, "writer is closed"
        self._writes.raise_if_failed()  # a file with a hole is not written on
        offset = align_up(self._end)
        size = data.numel()
        if size:
            future = self._file.pwrite(_buffer(data), size, offset)

            def wait(future: Any = future, size: int = size, data: torch.Tensor = data) -> None:
                # `data` is held here, so it stays alive until its write is done.
                written = future.get()
                if written != size:
                    raise OSError(f"{self.path}: KvikIO wrote {written} of {size} bytes")

            self._writes.add(wait, size)
        self._end = offset + size
        return offset

    def sync(self) -> int:
        assert self._file is not None, "writer is closed"
        self._writes.wait_all()
        os.fsync(self._file.fileno())
        return self._end

    def close(self) -> None:
        if self._file is None:
            return
        try:
            # Never free a buffer KvikIO may still be reading: wait for every queued write.
            for wait in self._writes.discard():
                try:
                    wait()
                except Exception:  # noqa: BLE001 - the failure is already being reported
                    log.debug("asyncckpt: a write failed while closing %s", self.path)
        finally:
            self._file.close()
            self._file = None


class KvikioBlobReader:
    """Reads blobs into device memory of ``device``."""

    def __init__(self, path: Path, device: torch.device) -> None:
        self.path = path
        self.device = device
        self._file: Any = kvikio().CuFile(path, "r")

    def read_async(self, offset: int, size: int) -> tuple[torch.Tensor, Any]:
        """Start reading ``size`` bytes at ``offset`` into a new device buffer: (buffer, future or None)."""
        assert self._file is not None, "reader is closed"
        out = torch.empty(size, dtype=torch.uint8, device=self.device)
        if size:
            # cuFile's DMA is not ordered on any stream: work still queued on the stream `out` was
            # allocated from may use that memory, so let it finish first.
            torch.cuda.current_stream(self.device).synchronize()
        return out, (self._file.pread(out, size, offset) if size else None)

    def finish(self, future: Any, offset: int, size: int) -> None:
        if future is not None and future.get() != size:
            raise CorruptCheckpointError(f"{self.path}: file ends before byte {offset + size}; it is truncated")

    def read(self, offset: int, size: int) -> torch.Tensor:
        out, future = self.read_async(offset, size)
        self.finish(future, offset, size)
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class DeviceBlobReader(Protocol):
    """Reads byte ranges of one file into new device buffers; one thread uses it."""

    def read_async(self, offset: int, size: int) -> tuple[torch.Tensor, Any]: ...
    def finish(self, future: Any, offset: int, size: int) -> None: ...
    def close(self) -> None: ...


COMPAT_IO_ENV = "ASYNCCKPT_COMPAT_IO"
"""Set to ``kvikio`` to do compat-mode I/O through KvikIO's thread pool instead of :mod:`.pinned_io`."""


def _kvikio_compat() -> bool:
    return os.environ.get(COMPAT_IO_ENV, "").strip().lower() == "kvikio"


def open_device_reader(path: Path, device: torch.device) -> DeviceBlobReader:
    """KvikIO straight into device memory under GDS; :class:`PinnedPosixReader` in compat mode."""
    if io_mode() == "gds" or _kvikio_compat():
        return KvikioBlobReader(path, device)
    return PinnedPosixReader(path, device)


def open_device_writer(path: Path, device: torch.device, inflight_bytes: int) -> BlobWriter:
    """KvikIO (cuFile DMA) under GDS; :class:`PinnedPosixWriter` in compat mode (:mod:`.pinned_io` says why)."""
    if io_mode() == "gds" or _kvikio_compat():
        return KvikioBlobWriter(path, inflight_bytes)
    return PinnedPosixWriter(path, device, inflight_bytes)


class KvikioStorage:
    """Storage through KvikIO (GDS or compat); device and host buffers alike."""

    def __init__(self, device: torch.device, io_threads: int = 0, inflight_bytes: int = DEFAULT_INFLIGHT_BYTES) -> None:
        self.device = device
        self.threads = configure_threads(io_threads)
        self.io_mode = io_mode()
        self.inflight_bytes = inflight_bytes

    def open_writer(self, path: Path) -> BlobWriter:
        return open_device_writer(path, self.device, self.inflight_bytes)

    def open_reader(self, path: Path) -> KvikioBlobReader:
        return KvikioBlobReader(path, self.device)

    def register(self, buf: torch.Tensor) -> None:
        """Register a long-lived device buffer with cuFile (only meaningful, and only done, under GDS)."""
        if self.io_mode == "gds":
            kvikio().memory_register(buf)

    def deregister(self, buf: torch.Tensor) -> None:
        if self.io_mode == "gds":
            kvikio().memory_deregister(buf)
