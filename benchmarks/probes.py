"""The physical limits, measured in the same run as the checkpoints they bound.

* storage: a plain large sequential ``write`` + ``fsync`` (what any checkpoint must at least
  pay for its bytes), then a read of the same file after dropping it from the page cache with
  ``posix_fadvise(DONTNEED)`` ("cold-ish": the device's own cache may still hold it);
* copies: device-to-device, device-to-pinned-host and device-to-pageable-host (timed with CUDA
  events), and host-to-host ``memcpy`` (what a CPU snapshot costs).

Every probe runs on the calling (main) thread and returns bytes per second.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .common import median

BLOCK_BYTES = 64 << 20


def storage_bandwidth(directory: Path, total_bytes: int, repeats: int = 2) -> dict[str, Any]:
    """:func:`storage_pass` ``repeats`` times; the best pass is the limit (a shared disk is only ever slower)."""
    passes = [storage_pass(directory, total_bytes) for _ in range(repeats)]
    best = max(passes, key=lambda p: p["write_bytes_per_second"])
    reads = [p["read_bytes_per_second"] for p in passes if p["read_bytes_per_second"]]
    return {**best, "read_bytes_per_second": max(reads) if reads else None,
            "write_passes_bytes_per_second": [p["write_bytes_per_second"] for p in passes]}  # fmt: skip


def storage_pass(directory: Path, total_bytes: int) -> dict[str, Any]:
    """Write ``total_bytes`` to a new file in ``directory``, fsync, drop it from the page cache, read it back."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "bandwidth-probe.bin"
    block_bytes = min(BLOCK_BYTES, max(1 << 20, total_bytes))
    # Random bytes: a file system or device that compresses or deduplicates would flatter zeros.
    block = np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8)
    view = memoryview(block.tobytes())
    blocks = max(1, total_bytes // block_bytes)
    written = blocks * block_bytes
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        began = time.perf_counter()
        for _ in range(blocks):
            done = 0
            while done < block_bytes:
                done += os.write(fd, view[done:])
        os.fsync(fd)
        write_seconds = time.perf_counter() - began
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    buffer = bytearray(block_bytes)
    with open(path, "rb", buffering=0) as f:
        began = time.perf_counter()
        read = 0
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            read += n
        read_seconds = time.perf_counter() - began
    path.unlink()
    return {
        "bytes": written,
        "write_bytes_per_second": written / write_seconds,
        "read_bytes_per_second": read / read_seconds if read_seconds > 0 else None,
        "read_cache": "posix_fadvise(DONTNEED) after fsync" if hasattr(os, "posix_fadvise") else "page cache warm",
    }


def _cuda_copy_rate(dst: torch.Tensor, src: torch.Tensor, repeats: int = 3) -> float:
    """Bytes per second of ``dst.copy_(src)`` on the current stream, median of ``repeats`` after a warm-up."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    rates = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(src.numel() * src.element_size() / (start.elapsed_time(end) / 1e3))
    return median(rates) or 0.0


def copy_bandwidth(device: torch.device, total_bytes: int) -> dict[str, Any]:
    """Copy rates that bound a snapshot: D2D, D2H pinned/pageable (CUDA only) and host memcpy."""
    out: dict[str, Any] = {"bytes": total_bytes}
    src_host = torch.ones(total_bytes, dtype=torch.uint8)
    dst_host = torch.empty_like(src_host)
    rates = []
    for _ in range(3):
        began = time.perf_counter()
        dst_host.copy_(src_host)
        rates.append(total_bytes / (time.perf_counter() - began))
    out["host_copy_bytes_per_second"] = median(rates)
    del src_host
    if device.type == "cuda":
        src = torch.ones(total_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        out["d2d_bytes_per_second"] = _cuda_copy_rate(dst, src)
        del dst
        pinned = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=True)
        out["d2h_pinned_bytes_per_second"] = _cuda_copy_rate(pinned, src)
        del pinned
        out["d2h_pageable_bytes_per_second"] = _cuda_copy_rate(dst_host, src, repeats=2)
        del src
    del dst_host
    return out
