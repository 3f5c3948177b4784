"""The CPU codec: Zstandard on byte planes, chunked, compressed by a thread pool.

Floating-point tensors are split into byte planes first (see :mod:`.planes`); integer and
boolean tensors are compressed as they are. Each chunk is one standard Zstandard frame, so
any zstd library can read it. ``zstandard`` releases the GIL while it works, so the pool's
threads use every core. All work runs on the checkpoint worker thread (encode) or the loading
thread (decode) and their pool; host memory only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import zstandard

from .._dtypes import FLOATING_NAMES, dtype_name
from ..errors import CorruptCheckpointError
from . import planes as byte_planes
from .base import EncodedBlob, PerTensorEncoder
from .rawchunks import checked_planes, chunk_views

DEFAULT_CHUNK_BYTES = 4 << 20
"""Raw bytes per chunk: large enough for a good ratio, small enough to spread over cores."""

_local = threading.local()  # zstd (de)compressor objects are not thread-safe: one per thread


def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="asyncckpt-zstd")


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _planes_for(dtype: torch.dtype) -> int:
    name = dtype_name(dtype)
    return dtype.itemsize if name in FLOATING_NAMES and dtype.itemsize > 1 else 1


class ZstdCodec(PerTensorEncoder):
    """Encoder and decoder for ``"zstd"`` (host buffers only)."""

    name = "zstd"

    def __init__(self, level: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES, threads: int | None = None) -> None:
        if not -7 <= level <= 22:
            raise ValueError(f"zstd level must be in [-7, 22], got {level}")
        if chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be at least 4096, got {chunk_bytes}")
        self.level = level
        self.chunk_bytes = chunk_bytes
        self._executor = _pool(threads or default_threads())

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def encode(self, raw: torch.Tensor, dtype: torch.dtype, key: str) -> EncodedBlob:
        if raw.device.type != "cpu":
            raise ValueError("the zstd CPU codec takes host buffers; use an nvCOMP codec for device buffers")
        planes = _planes_for(dtype)
        data = raw.numpy()
        step = self.chunk_bytes - self.chunk_bytes % (planes * 16)
        bounds = [(start, min(start + step, data.size)) for start in range(0, data.size, step)] or [(0, 0)]
        frames = list(self._executor.map(lambda b: self._compress(data[b[0] : b[1]], planes), bounds))
        joined = np.frombuffer(bytearray().join(frames), dtype=np.uint8)
        return EncodedBlob(
            data=torch.from_numpy(joined),
            codec="zstd",
            chunks=[(len(f), hi - lo) for f, (lo, hi) in zip(frames, bounds, strict=False)],
            params={"planes": planes},
        )

    def _compress(self, chunk: np.ndarray, planes: int) -> bytes:
        compressor = getattr(_local, "compressor", None)
        if compressor is None or getattr(_local, "level", None) != self.level:
            compressor = _local.compressor = zstandard.ZstdCompressor(level=self.level, write_content_size=True)
            _local.level = self.level
        return compressor.compress(byte_planes.split(chunk, planes).data)

    def decode(
        self, blob: torch.Tensor, chunks: list[tuple[int, int]], params: Mapping[str, Any], out: torch.Tensor
    ) -> None:
        planes = checked_planes("zstd", params)
        jobs = chunk_views("zstd", blob.numpy(), out.numpy(), chunks, planes)
        if len(jobs) == 1:  # most tensors of a state are one chunk: the pool's hand-off would cost more
            _decompress_into(jobs[0][0], jobs[0][1], planes)
            return
        for _ in self._executor.map(lambda job: _decompress_into(job[0], job[1], planes), jobs):
            pass


def _decompress_into(frame: np.ndarray, out: np.ndarray, planes: int) -> None:
    decompressor = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    try:
        # The header's content size, when present, is what decompress() allocates, before
        # max_output_size is looked at: it must be the recorded size, checked first.
        declared = zstandard.frame_content_size(frame.data)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"zstd: chunk is not a Zstandard frame: {exc}") from exc
    if declared not in (-1, out.size):
        raise CorruptCheckpointError(f"zstd: frame header declares {declared} bytes, the manifest {out.size}")
    try:
        # max_output_size bounds memory for a frame without a content size.
        plain = decompressor.decompress(frame.data, max_output_size=max(out.size, 1))
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"zstd: chunk does not decode: {exc}") from exc
    except MemoryError as exc:  # e.g. a window size beyond this machine: still a frame this writer never makes
        raise CorruptCheckpointError(f"zstd: chunk needs more memory to decode than its {out.size} bytes") from exc
    if len(plain) != out.size:
        raise CorruptCheckpointError(f"zstd: chunk decoded to {len(plain)} bytes, expected {out.size}")
    byte_planes.join(np.frombuffer(plain, dtype=np.uint8), planes, out)
