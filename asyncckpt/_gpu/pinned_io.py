"""POSIX I/O of device memory through two pinned host buffers: what runs where GDS is off.

One private thread per file issues large sequential ``pread``/``pwrite`` calls (which release
the GIL), and device-host copies on a private stream overlap the system calls. KvikIO's compat
mode does POSIX I/O through pinned bounce buffers too, but as many small tasks over its thread
pool, each a copy plus a stream synchronisation, which slowed training more and read slower on
the H200 (figures: docs/benchmarks.md, "Why the GPU path is built this way").
``ASYNCCKPT_COMPAT_IO=kvikio`` keeps KvikIO's compat mode instead
(:func:`asyncckpt._gpu.storage.open_device_writer`).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .._storage import InflightWrites, align_up
from .._storage.posix import create_for_writing, open_for_reading, pread_fully, pwrite_fully
from ..errors import CorruptCheckpointError

PIECE_BYTES = 64 << 20
"""Bytes per ``pread``/``pwrite`` (also the size of each of the two pinned buffers)."""


class PinnedPosixReader:
    """Reads into device memory with large sequential ``pread`` calls through two pinned host buffers.

    What a restore uses where GDS is off. KvikIO's compat mode does the same POSIX reads cut
    into 4 MiB tasks over its thread pool; one thread's 64 MiB sequential reads keep the
    kernel's readahead on a single stream, which reads faster (docs/benchmarks.md, "Why the
    GPU path is built this way"). While piece k is copied to the GPU on a private stream, piece
    k+1 is read.

    Threads: requests run in order on one private reader thread (``asyncckpt-read``), so the
    file is read front to back; ``finish`` waits for a request and reports a short file.
    """

    def __init__(self, path: Path, device: torch.device) -> None:
        self.path = path
        self.device = device
        self._fd: int | None = open_for_reading(path)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-read")
        self._stream = torch.cuda.Stream(device=device)
        self._pinned = [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._pieces = 0

    def read_async(self, offset: int, size: int) -> tuple[torch.Tensor, Future[int] | None]:
        """Queue a read of ``size`` bytes at ``offset`` into a new device buffer: (buffer, future or None)."""
        assert self._fd is not None, "reader is closed"
        out = torch.empty(size, dtype=torch.uint8, device=self.device)
        # `out` comes from the caller's stream's pool: its memory may still be in use by work
        # queued there, so the reader's stream starts after that work.
        allocated = torch.cuda.Event()
        allocated.record(torch.cuda.current_stream(self.device))
        return out, (self._pool.submit(self._read_into, out, offset, allocated) if size else None)

    def finish(self, future: Future[int] | None, offset: int, size: int) -> None:
        if future is not None and future.result() != size:
            raise CorruptCheckpointError(f"{self.path}: file ends before byte {offset + size}; it is truncated")

    def _read_into(self, out: torch.Tensor, offset: int, allocated: torch.cuda.Event) -> int:
        """Reader thread: fill ``out`` from ``offset``; returns the bytes read (fewer at end of file)."""
        assert self._fd is not None
        size, done = out.numel(), 0
        self._stream.wait_event(allocated)
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                while done < size:
                    slot = self._pieces % 2
                    previous = self._copied[slot]
                    if previous is not None:
                        previous.synchronize()  # this buffer's last copy to the GPU has finished
                    n = min(PIECE_BYTES, size - done)
                    piece = self._pinned[slot][:n]
                    got = pread_fully(self._fd, piece.numpy(), offset + done)
                    if got:
                        out[done : done + got].copy_(piece[:got], non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(self._stream)
                        self._copied[slot] = event
                        self._pieces += 1
                        done += got
                    if got < n:
                        break
        finally:
            # `out` is complete once the future resolves, and after a failed read no copy may
            # still be writing into it when the caller lets it go.
            self._stream.synchronize()
        return done

    def close(self) -> None:
        if self._fd is None:
            return
        self._pool.shutdown(wait=True)  # no read may still write into a buffer
        os.close(self._fd)
        self._fd = None


class PinnedPosixWriter:
    """Appends device (or host) buffers to a new file at 4 KiB-aligned offsets, through pinned memory.

    ``append`` returns the offset at once; the bytes are written in order by one private writer
    thread (``asyncckpt-write``): piece k+1 is copied from the GPU (private stream) while piece k
    is written. The writer keeps every buffer alive until it is written and bounds the bytes
    queued to ``inflight_bytes`` (``append`` waits for the oldest write beyond that). ``sync``
    waits for every write, then ``fsync``\\s; the first failed write (a full disk) is raised by
    the ``append`` or ``sync`` that waits for it, and by every call after that. Used by one
    thread (the checkpoint worker).

    Device buffers are complete when appended (the :class:`~asyncckpt._storage.BlobWriter`
    contract: the compressor synchronises its stream before it hands a group over, and
    ``write_part`` waits for the snapshot's staging copies before its first append), so the
    copies wait for no stream: an event on the worker's current stream, which is training's
    default stream, would hold each write behind the training work queued when it was appended.
    """

    def __init__(self, path: Path, device: torch.device, inflight_bytes: int) -> None:
        self.path = path
        self.device = device
        self._fd: int | None = create_for_writing(path)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-write")
        self._stream = torch.cuda.Stream(device=device)
        self._pinned = [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._writes = InflightWrites(inflight_bytes)
        self._end = 0

    def append(self, data: torch.Tensor) -> int:
        assert self._fd is not None, "writer is closed"
        assert data.dtype == torch.uint8 and data.dim() == 1 and data.is_contiguous(), "blobs are 1-D uint8 bytes"
        self._writes.raise_if_failed()  # a file with a hole is not written on
        offset = align_up(self._end)
        size = data.numel()
        if size:
            self._writes.add(self._pool.submit(self._write, data, offset).result, size)
        self._end = offset + size
        return offset

    def _write(self, data: torch.Tensor, offset: int) -> None:
        """Writer thread: all of ``data`` (complete, see the class docstring) at ``offset``."""
        assert self._fd is not None
        if data.is_cuda and data.device != self.device:  # another GPU's memory: a plain synchronous copy
            data = data.cpu()
        if not data.is_cuda:
            pwrite_fully(self._fd, data.numpy(), offset)
            return
        pending: tuple[torch.Tensor, torch.cuda.Event, int] | None = None
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                for k, start in enumerate(range(0, data.numel(), PIECE_BYTES)):
                    piece = self._pinned[k % 2][: min(PIECE_BYTES, data.numel() - start)]
                    piece.copy_(data[start : start + piece.numel()], non_blocking=True)
                    copied = torch.cuda.Event()
                    copied.record(self._stream)
                    if pending is not None:  # written while this piece crosses to the host
                        self._flush(*pending)
                    pending = (piece, copied, offset + start)
                if pending is not None:
                    self._flush(*pending)
        finally:
            self._stream.synchronize()  # no copy may still fill a pinned buffer the next write uses

    def _flush(self, piece: torch.Tensor, copied: torch.cuda.Event, offset: int) -> None:
        assert self._fd is not None
        copied.synchronize()
        pwrite_fully(self._fd, piece.numpy(), offset)

    def sync(self) -> int:
        assert self._fd is not None, "writer is closed"
        self._writes.wait_all()
        os.fsync(self._fd)
        return self._end

    def close(self) -> None:
        if self._fd is None:
            return
        # Writes not yet started are dropped (after a failure the file is deleted anyway); a
        # running one finishes first: never free a buffer a write may still read.
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._writes.discard()
        os.close(self._fd)
        self._fd = None
