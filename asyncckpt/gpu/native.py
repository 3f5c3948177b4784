"""nvCOMP's C batched compression API through ctypes, for the codecs that run beside training (ANS, Bitcomp).

Contract: building and enqueueing a batch neither waits for other streams' GPU work nor holds
the GIL while the GPU works. nvCOMP's Python API breaks both (``nvcomp.as_arrays`` waits for every
stream, training's included, holding the GIL: docs/benchmarks.md, "Why the GPU path is built
this way"). Here the chunk tables (pointers and sizes) go up from pinned memory with an
asynchronous copy on the compressor's stream, the compressed sizes come back the same way, and
ctypes lets go of the GIL for the call, which only enqueues work.

Same formats: a RAW chunk of the Python API is one chunk of the C batched API. Bitcomp's bytes
are identical; ANS's may differ from the Python API's (an option default) and decode with it
(``tests/gpu/test_gpu_native.py``). Decoding, and the codecs not listed in :data:`SUPPORTED`,
stay on the Python API (a restore does not run beside training). The option structs below are
nvCOMP 6's (``include/nvcomp/ans.h``, ``bitcomp.h``): with any other major version
:func:`available` is False and everything uses the Python API, as it does with
``ASYNCCKPT_NVCOMP_PYTHON_ONLY=1`` (for comparisons).

Threads and streams: any thread may call :func:`encode`; all GPU work goes on the stream it
is given; :meth:`NativeEncode.sizes` is where the calling thread waits (without the GIL).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..alignment import align_up
from .specs import CodecSpec

SUPPORTED = frozenset({"ans", "bitcomp"})
"""Codecs compressed through the C API when :func:`available`."""
NVCOMP_MAJOR = 6
OUTPUT_ALIGN_BYTES = 16

_NVCOMP_TYPES = {"|i1": 0, "|u1": 1, "<i2": 2, "<u2": 3, "<i4": 4, "<u4": 5, "<i8": 6, "<u8": 7,
                 "<f2": 10, "<f4": 11, "<f8": 12}  # fmt: skip
"""``nvcompType_t`` of each data type string (``include/nvcomp/shared_types.h``)."""


class _AnsOpts(ctypes.Structure):
    """``nvcompBatchedANSCompressOpts_t``: 64 bytes, the unused ones zero."""

    _fields_ = [
        ("type", ctypes.c_int),  # nvcomp_rANS = 0
        ("data_type", ctypes.c_int),
        ("max_sub_chunk_count", ctypes.c_uint8),  # 0: nvCOMP's default
        ("states_per_lane", ctypes.c_uint8),
        ("histogram_reduction_log2", ctypes.c_uint8),
        ("reserved", ctypes.c_char * 53),
    ]


class _BitcompOpts(ctypes.Structure):
    """``nvcompBatchedBitcompCompressOpts_t``: 64 bytes, lossless, default algorithm."""

    _fields_ = [
        ("algorithm", ctypes.c_int),
        ("data_type", ctypes.c_int),
        ("delta", ctypes.c_double),
        ("mode", ctypes.c_int),  # BITCOMP_LOSSLESS = 0
        ("reserved", ctypes.c_char * 44),
    ]


class _Properties(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


_NAMES = {"ans": "ANS", "bitcomp": "Bitcomp"}
_ANS_TYPES = frozenset({"|u1", "|i1", "<f2", "<f4"})
"""The data types nvCOMP's ANS takes (``ans.h``); Bitcomp takes every one in :data:`_NVCOMP_TYPES`."""
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_loaded = False
_bounds: dict[tuple[CodecSpec, int], int] = {}
_temp_sizes: dict[tuple[CodecSpec, int, int, int, int], int] = {}


def _find_library() -> ctypes.CDLL | None:
    """libnvcomp of major version 6 from the ``nvidia-libnvcomp`` wheel, else the loader's path; None if absent."""
    try:
        spec = importlib.util.find_spec("nvidia.libnvcomp")
    except (ImportError, ValueError):  # no `nvidia` namespace package at all
        spec = None
    candidates = []
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        for sub in ("lib64", "lib", "bin"):
            candidates += sorted(glob.glob(os.path.join(location, sub, f"libnvcomp.so.{NVCOMP_MAJOR}*")))
    # Only the wheel's library, the one nvCOMP's Python API (which decodes) loads: a stray
    # libnvcomp.so.6 on the loader's path beside a Python API of another version would mix them.
    for name in candidates:
        try:
            lib = ctypes.CDLL(name, ctypes.RTLD_LOCAL)
        except OSError:
            continue
        properties = _Properties()
        try:
            ok = lib.nvcompGetProperties(ctypes.byref(properties)) == 0
        except AttributeError:  # not an nvCOMP we know
            continue
        if ok and properties.version // 1000 == NVCOMP_MAJOR:
            return lib
    return None


def _lib() -> ctypes.CDLL | None:
    global _library, _loaded
    with _lock:
        if not _loaded:
            if os.environ.get("ASYNCCKPT_NVCOMP_PYTHON_ONLY", "").strip() not in ("", "0"):
                _library = None  # for comparisons: every encode through nvCOMP's Python API
            else:
                _library = _find_library()
            _loaded = True
        return _library


def available(spec: CodecSpec) -> bool:
    """Whether ``spec`` compresses through the C API here (nvCOMP 6 found, a supported codec and type)."""
    data_type = spec.data_type or "|u1"
    known = data_type in (_ANS_TYPES if spec.codec == "ans" else _NVCOMP_TYPES)
    return spec.codec in SUPPORTED and known and _lib() is not None


def _opts(spec: CodecSpec) -> ctypes.Structure:
    data_type = _NVCOMP_TYPES[spec.data_type or "|u1"]
    if spec.codec == "ans":
        return _AnsOpts(type=0, data_type=data_type)
    return _BitcompOpts(algorithm=0, data_type=data_type, delta=0.0, mode=0)


def _call(name: str, *args: Any) -> None:
    lib = _lib()
    assert lib is not None
    status = getattr(lib, name)(*args)
    if status != 0:
        lib.nvcompGetStatusString.restype = ctypes.c_char_p
        text = lib.nvcompGetStatusString(status)
        raise RuntimeError(f"nvCOMP {name} failed: status {status} ({(text or b'?').decode()})")


def max_compressed_bytes(spec: CodecSpec, chunk_bytes: int) -> int:
    """nvCOMP's bound on one compressed chunk of at most ``chunk_bytes``, rounded up to 16 bytes."""
    key = (spec, chunk_bytes)
    if key not in _bounds:
        out = ctypes.c_size_t()
        _call(f"nvcompBatched{_NAMES[spec.codec]}CompressGetMaxOutputChunkSize",
              ctypes.c_size_t(chunk_bytes), _opts(spec), ctypes.byref(out))  # fmt: skip
        _bounds[key] = align_up(out.value, OUTPUT_ALIGN_BYTES)
    return _bounds[key]


@dataclass
class NativeEncode:
    """One C-API batched encode in flight; holds its device tables and the pinned buffer the sizes land in."""

    spec: CodecSpec
    count: int
    out: torch.Tensor
    out_offsets: list[int]
    done: torch.cuda.Event
    host_results: torch.Tensor
    """Pinned: compressed sizes (``count`` int64), then statuses (``count`` int32)."""
    keep_alive: list[Any] = field(default_factory=list)
    _sizes: list[int] | None = None

    def sizes(self) -> list[int]:
        """Compressed size of every chunk; blocks (without the GIL) until the encode is done."""
        if self._sizes is None:
            self.done.synchronize()
            statuses = self.host_results[self.count :].view(torch.int32)[: self.count].numpy()
            failed = np.flatnonzero(statuses)
            if failed.size:
                i = int(failed[0])
                raise RuntimeError(f"nvCOMP {self.spec}: chunk {i} of {self.count} failed with status {statuses[i]}")
            self._sizes = self.host_results[: self.count].tolist()
            self.keep_alive.clear()
        return self._sizes


def encode(spec: CodecSpec, sources: np.ndarray, raw_sizes: np.ndarray, chunk_bytes: int,
           stream: torch.cuda.Stream, began: torch.cuda.Event | None = None,
           ended: torch.cuda.Event | None = None) -> NativeEncode:  # fmt: skip
    """Enqueue a batched encode of the chunks at device addresses ``sources`` (sizes ``raw_sizes``) on ``stream``.

    Every chunk is at most ``chunk_bytes`` and aligned as nvCOMP requires for ``spec`` (the
    caller's job, as with the Python API). ``began``/``ended``, if given, are recorded around
    the compression kernels. Nothing here waits for the GPU.
    """
    count = len(raw_sizes)
    bound = max_compressed_bytes(spec, chunk_bytes)
    opts = _opts(spec)
    name = _NAMES[spec.codec]
    temp_key = (spec, count, chunk_bytes, int(raw_sizes.sum()), stream.device.index or 0)
    if temp_key not in _temp_sizes:  # the same groups come back at every save
        needed = ctypes.c_size_t()
        _call(f"nvcompBatched{name}CompressGetTempSize", ctypes.c_size_t(count), ctypes.c_size_t(chunk_bytes), opts,
              ctypes.byref(needed), ctypes.c_size_t(temp_key[3]), ctypes.c_void_p(stream.cuda_stream))  # fmt: skip
        with _lock:
            _temp_sizes[temp_key] = needed.value
    temp_bytes = _temp_sizes[temp_key]
    with torch.cuda.stream(stream):  # the calling thread's current device is the stream's
        out = torch.empty(max(count * bound, 1), dtype=torch.uint8, device=stream.device)
        out_offsets = np.arange(count, dtype=np.int64) * bound
        host_table = torch.empty(3 * count, dtype=torch.int64, pin_memory=True)
        table = host_table.numpy()
        table[:count] = sources
        table[count : 2 * count] = raw_sizes
        table[2 * count :] = out.data_ptr() + out_offsets
        # Device side: the three tables, then the compressed sizes and the statuses (count int64 each).
        device_table = torch.empty(5 * count, dtype=torch.int64, device=stream.device)
        device_table[: 3 * count].copy_(host_table, non_blocking=True)
        temp = torch.empty(max(temp_bytes, 1), dtype=torch.uint8, device=stream.device)
        base, word = device_table.data_ptr(), 8
        if began is not None:
            began.record(stream)
        _call(
            f"nvcompBatched{name}CompressAsync",
            ctypes.c_void_p(base),
            ctypes.c_void_p(base + count * word),
            ctypes.c_size_t(chunk_bytes),
            ctypes.c_size_t(count),
            ctypes.c_void_p(temp.data_ptr()),
            ctypes.c_size_t(temp_bytes),
            ctypes.c_void_p(base + 2 * count * word),
            ctypes.c_void_p(base + 3 * count * word),
            opts,
            ctypes.c_void_p(base + 4 * count * word),
            ctypes.c_void_p(stream.cuda_stream),
        )
        if ended is not None:
            ended.record(stream)
        host_results = torch.empty(2 * count, dtype=torch.int64, pin_memory=True)
        host_results.copy_(device_table[3 * count :], non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return NativeEncode(
        spec=spec,
        count=count,
        out=out,
        out_offsets=out_offsets.tolist(),
        done=done,
        host_results=host_results,
        keep_alive=[host_table, device_table, temp],
    )
