"""The CUDA kernels torch has no single operation for, each one launch per call.

They run while training runs, so they are written to cost the GPU and the GIL as little as a
launch (docs/benchmarks.md, "Why the GPU path is built this way", has the figures).

``copy_ranges``
    ``dst_ptrs[i][0:sizes[i]] = src_ptrs[i][0:sizes[i]]`` for every i, in one launch: one
    block column per range, 32-bit stores at any byte alignment.
``split_planes`` / ``join_planes``
    The tensor-wide byte-plane split of :mod:`asyncckpt._gpu.planes` and its inverse, with
    32-bit accesses to the plane rows.

Compiled once per process with NVRTC through CuPy (part of the GPU extra) and launched through
the driver on the stream the caller passes; nothing here waits for the GPU. Any thread may call;
CuPy's kernel objects are thread-safe once compiled, and compilation is guarded by a lock.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np
import torch

from .deps import cupy

_SOURCE = r"""
typedef unsigned long long u64;

extern "C" __global__ void copy_ranges(const u64* src_ptrs, const u64* dst_ptrs, const u64* sizes) {
    // blockIdx.x: the range; blockIdx.y: this block's share of it.
    const u64 n = sizes[blockIdx.x];
    const unsigned char* s = (const unsigned char*)src_ptrs[blockIdx.x];
    unsigned char* d = (unsigned char*)dst_ptrs[blockIdx.x];
    const u64 start = blockIdx.y * (u64)blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.y * blockDim.x;
    u64 head = (4 - ((u64)d & 3)) & 3;  // bytes until the destination is 4-byte aligned
    if (head > n) head = n;
    if (start < head) d[start] = s[start];
    const u64 words = (n - head) / 4;
    unsigned int* dw = (unsigned int*)(d + head);
    const unsigned char* sh = s + head;
    for (u64 i = start; i < words; i += stride) {
        const unsigned char* p = sh + 4 * i;  // byte loads: the source may have any alignment
        dw[i] = p[0] | (p[1] << 8) | (p[2] << 16) | ((unsigned int)p[3] << 24);
    }
    const u64 done = head + 4 * words;
    if (start < n - done) d[done + start] = s[done + start];
}

extern "C" __global__ void split_planes(const unsigned char* src, unsigned char* dst, u64 items, u64 stride,
                                        u64 planes) {
    // Thread q moves items 4q..4q+3: byte p of each goes to row p, as one 32-bit store per row.
    const u64 q = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    const u64 first = 4 * q;
    if (first >= items) return;
    const unsigned char* s = src + first * planes;
    if (first + 4 <= items) {
        for (u64 p = 0; p < planes; ++p) {
            const unsigned int word = s[p] | (s[planes + p] << 8) | (s[2 * planes + p] << 16)
                                      | ((unsigned int)s[3 * planes + p] << 24);
            *(unsigned int*)(dst + p * stride + first) = word;
        }
    } else {
        for (u64 k = 0; first + k < items; ++k)
            for (u64 p = 0; p < planes; ++p) dst[p * stride + first + k] = s[k * planes + p];
    }
}

extern "C" __global__ void join_planes(const unsigned char* src, unsigned char* dst, u64 items, u64 stride,
                                       u64 planes) {
    // The inverse of split_planes: one 32-bit load per row, bytes back into their items.
    const u64 q = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    const u64 first = 4 * q;
    if (first >= items) return;
    unsigned char* d = dst + first * planes;
    if (first + 4 <= items) {
        for (u64 p = 0; p < planes; ++p) {
            const unsigned int word = *(const unsigned int*)(src + p * stride + first);
            d[p] = word & 0xff;
            d[planes + p] = (word >> 8) & 0xff;
            d[2 * planes + p] = (word >> 16) & 0xff;
            d[3 * planes + p] = word >> 24;
        }
    } else {
        for (u64 k = 0; first + k < items; ++k)
            for (u64 p = 0; p < planes; ++p) d[k * planes + p] = src[p * stride + first + k];
    }
}
"""

_BLOCK = 256
_COPY_BLOCKS_PER_RANGE = 16
_module: Any = None
_lock = threading.Lock()


def _kernel(name: str) -> Any:
    global _module
    with _lock:
        if _module is None:
            _module = cupy().RawModule(code=_SOURCE, options=("--std=c++17",))
        return _module.get_function(name)


def _launch(name: str, stream: torch.cuda.Stream, grid: tuple[int, int], args: tuple[int, ...]) -> None:
    """Launch kernel ``name`` on ``stream`` itself (its handle goes to the driver; no ambient
    current-stream state of CuPy is involved). Every kernel parameter is a 64-bit integer."""
    cp = cupy()
    function = _kernel(name).kernel  # compiled for the current device on first use
    values = [ctypes.c_uint64(a) for a in args]
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    cp.cuda.driver.launchKernel(
        function.ptr, grid[0], grid[1], 1, _BLOCK, 1, 1, 0, stream.cuda_stream, ctypes.addressof(pointers), 0
    )


def copy_ranges(src_ptrs: np.ndarray, dst_ptrs: np.ndarray, sizes: np.ndarray, device: torch.device,
                stream: torch.cuda.Stream) -> torch.Tensor:  # fmt: skip
    """Enqueue ``dst[i][:sizes[i]] = src[i][:sizes[i]]`` for all i on ``stream`` (device addresses).

    ``count`` may be up to 2**31 - 1 (the grid's x limit). Returns the device table the kernel
    reads; the caller keeps it (and every source and destination) alive until the stream has
    passed the copy. Does not wait for the GPU.
    """
    count = len(sizes)
    if not count:
        return torch.empty(0, dtype=torch.int64, device=device)
    table = np.stack([src_ptrs, dst_ptrs, sizes]).astype(np.uint64).view(np.int64)
    with torch.cuda.stream(stream):
        # A pageable host-to-device copy returns once the driver has taken the bytes: `table` may go.
        on_device = torch.from_numpy(table).to(device, non_blocking=True)
        per_range = max(1, min(_COPY_BLOCKS_PER_RANGE, -(-int(sizes.max()) // (4 * _BLOCK))))
        base = on_device.data_ptr()  # rows: source addresses, destination addresses, sizes
        with torch.cuda.device(device):
            _launch("copy_ranges", stream, (count, per_range), (base, base + 8 * count, base + 16 * count))
    return on_device


def move_planes(src: torch.Tensor, dst: torch.Tensor, items: int, planes: int, stride: int, splitting: bool) -> None:
    """Enqueue :func:`split_planes` (``splitting``) or :func:`join_planes` on the current stream.

    ``items`` elements of ``planes`` bytes; plane rows ``stride`` bytes apart (a multiple of 4,
    the rows' buffer 4-byte aligned). Does not wait for the GPU.
    """
    rows = dst if splitting else src
    if stride % 4 or rows.data_ptr() % 4:
        raise ValueError("plane rows must be 4-byte aligned")
    quads = -(-items // 4)
    if not quads:
        return
    stream = torch.cuda.current_stream(src.device)
    with torch.cuda.device(src.device):
        _launch("split_planes" if splitting else "join_planes", stream, (-(-quads // _BLOCK), 1),
                (src.data_ptr(), dst.data_ptr(), items, stride, planes))  # fmt: skip
