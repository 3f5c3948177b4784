"""Checksums of blobs in GPU memory: CRC-32 through nvCOMP, the same value as ``zlib.crc32``.

The GPU path writes ``crc32`` like the CPU path, so any reader (``zlib``, a CPU-only machine)
checks a GPU-written checkpoint without a GPU; nvCOMP 6's batched CRC-32
(``nvcompBatchedCRC32Async``, :func:`asyncckpt._gpu.native.crc32`) computes it where the bytes
are. Checkpoints written before this (``mix64``) are verified on the host
(:func:`asyncckpt._checksum.mix64_host`), after a device-to-host copy.

Streams: the checksum runs on a private per-device stream, so it never queues behind training's
kernels on the default stream; the caller passes a buffer whose contents are already complete
(its producing stream synchronized, as the pipeline does before it checksums). The calling
thread blocks, without the GIL, until the value is on the host.

Without nvCOMP 6's library, or on a GPU with no memory left for the small tables, the value
is computed on the host from a device-to-host copy: slower, never a failed save.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .._checksum import crc32_host
from . import native as native

_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()


def _stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _streams:
            _streams[index] = torch.cuda.Stream(device=index)
        return _streams[index]


def crc32_device(buf: torch.Tensor) -> str:
    """The CRC-32 of a 1-D uint8 CUDA tensor, as 8 hex digits (``zlib.crc32``'s value).

    Blocks the calling thread until the value is known; see the module docstring for streams.
    """
    if buf.device.type != "cuda" or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(
            f"crc32_device takes a 1-D uint8 CUDA tensor, got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
        )
    if buf.numel() == 0:
        return crc32_host(np.empty(0, np.uint8))
    stream = _stream(buf.device)
    if native.crc32_available():
        try:
            with torch.cuda.device(buf.device):
                batch = native.crc32(np.array([buf.data_ptr()], np.int64), np.array([buf.numel()], np.int64), stream)
            (value,) = batch.values()
            return f"{value:08x}"
        except (torch.OutOfMemoryError, RuntimeError):  # no room for the tables, or nvCOMP reported a failure
            pass
    return crc32_host(_to_host(buf, stream))


def _to_host(buf: torch.Tensor, stream: torch.cuda.Stream) -> np.ndarray:
    """``buf``'s bytes on the host, copied on ``stream`` (never behind training's kernels on the
    default stream); blocks until they have landed."""
    with torch.cuda.device(buf.device), torch.cuda.stream(stream):
        host = buf.to("cpu", non_blocking=False)
    return host.numpy()
