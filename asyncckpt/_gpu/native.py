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

The same library's batched CRC-32 (:func:`crc32`, zlib's polynomial and conventions) checksums
the packed blobs where they are, one launch per group.

Threads and streams: any thread may call :func:`encode` or :func:`crc32`; all GPU work goes on the stream it
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

from .._alignment import align_up
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


class _Crc32Spec(ctypes.Structure):
    """``nvcompCRC32Spec_t`` (``include/nvcomp/crc32.h``): 32 bytes."""

    _fields_ = [
        ("poly", ctypes.c_uint32),
        ("init", ctypes.c_uint32),
        ("ref_in", ctypes.c_bool),
        ("ref_out", ctypes.c_bool),
        ("xorout", ctypes.c_uint32),
        ("reserved", ctypes.c_char * 16),
    ]


class _Crc32KernelConf(ctypes.Structure):
    """``nvcompCRC32KernelConf_t``: 32 bytes, filled by ``nvcompBatchedCRC32GetHeuristicConf``."""

    _fields_ = [
        ("kernel_kind", ctypes.c_int),
        ("bytes_per_read", ctypes.c_int32),
        ("blocks_per_msg", ctypes.c_int32),
        ("reserved", ctypes.c_char * 20),
    ]


class _Crc32Opts(ctypes.Structure):
    """``nvcompBatchedCRC32Opts_t``: 128 bytes."""

    _fields_ = [("spec", _Crc32Spec), ("kernel_conf", _Crc32KernelConf), ("reserved", ctypes.c_char * 64)]


_CRC32_ZLIB = dict(poly=0x04C11DB7, init=0xFFFFFFFF, ref_in=True, ref_out=True, xorout=0xFFFFFFFF)
"""nvCOMP's ``nvcompCRC32`` preset: CRC-32/ISO-HDLC, the value of ``zlib.crc32``."""
_CRC32_ONLY_SEGMENT = 0
"""``nvcompCRC32OnlySegment``: each chunk is a whole message."""


class _Properties(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("cudart_version", ctypes.c_uint32)]


_NAMES = {"ans": "ANS", "bitcomp": "Bitcomp"}
_ANS_TYPES = frozenset({"|u1", "|i1", "<f2", "<f4"})
"""The data types nvCOMP's ANS takes (``ans.h``); Bitcomp takes every one in :data:`_NVCOMP_TYPES`."""
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_loaded = False
_wheel_library: ctypes.CDLL | None = None
_wheel_loaded = False
_crc_confs: dict[tuple[int, int, int], _Crc32KernelConf] = {}
_MAX_CACHED_CONFS = 1024
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
    """The library compression goes through; None also under ``ASYNCCKPT_NVCOMP_PYTHON_ONLY``."""
    global _library, _loaded
    with _lock:
        if not _loaded:
            if os.environ.get("ASYNCCKPT_NVCOMP_PYTHON_ONLY", "").strip() not in ("", "0"):
                _library = None  # for comparisons: every encode through nvCOMP's Python API
            else:
                _library = _wheel_lib()
            _loaded = True
        return _library


def _wheel_lib() -> ctypes.CDLL | None:
    """libnvcomp 6 whatever the comparison switch says: checksums have no Python-API twin."""
    global _wheel_library, _wheel_loaded
    if not _wheel_loaded:
        _wheel_library = _find_library()
        _wheel_loaded = True
    return _wheel_library


def crc32_available() -> bool:
    """Whether :func:`crc32` can run here (nvCOMP 6's library found)."""
    with _lock:
        return _wheel_lib() is not None


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
    with _lock:
        lib = _wheel_lib()
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


@dataclass
class Crc32Batch:
    """CRC-32 values of a batch of device buffers, in flight on one stream."""

    count: int
    done: torch.cuda.Event
    host_results: torch.Tensor
    """Pinned: ``count`` CRC values (uint32, stored as int64), then ``count`` statuses."""
    keep_alive: list[Any] = field(default_factory=list)

    def values(self) -> list[int]:
        """The CRC-32 of every buffer, as ``zlib.crc32`` gives it; blocks (without the GIL) until computed."""
        self.done.synchronize()
        self.keep_alive.clear()
        statuses = self.host_results[self.count :].numpy()
        failed = np.flatnonzero(statuses)
        if failed.size:
            i = int(failed[0])
            raise RuntimeError(f"nvCOMP CRC32: buffer {i} of {self.count} failed with status {statuses[i]}")
        return [v & 0xFFFFFFFF for v in self.host_results[: self.count].tolist()]


def _crc_conf(count: int, max_bytes: int, device_index: int) -> _Crc32KernelConf:
    # nvCOMP's heuristic depends on the GPU, the chunk count and the largest chunk; a power-of-two
    # bucket of the largest chunk keeps the cache small across saves of differently sized tensors.
    bucket = 1 << max(0, max_bytes - 1).bit_length()
    key = (count, bucket, device_index)
    conf = _crc_confs.get(key)
    if conf is None:
        conf = _Crc32KernelConf()
        _call("nvcompBatchedCRC32GetHeuristicConf", ctypes.c_void_p(None), ctypes.c_size_t(count), ctypes.byref(conf),
              ctypes.c_size_t(bucket), ctypes.c_void_p(None))  # fmt: skip
        with _lock:
            if len(_crc_confs) >= _MAX_CACHED_CONFS:  # one entry per blob count seen: bound a long run's cache
                _crc_confs.clear()
            _crc_confs[key] = conf
    return conf


def crc32(addresses: np.ndarray, sizes: np.ndarray, stream: torch.cuda.Stream) -> Crc32Batch:
    """Enqueue the CRC-32 (zlib's) of the device buffers at ``addresses`` (``sizes`` bytes) on ``stream``.

    One nvCOMP launch for the whole batch; buffers need no alignment and may be empty. The
    buffers must be complete in stream order on ``stream``. Nothing here waits for the GPU;
    :meth:`Crc32Batch.values` does.
    """
    count = len(sizes)
    conf = _crc_conf(count, int(sizes.max()) if count else 0, stream.device.index or 0)
    opts = _Crc32Opts(spec=_Crc32Spec(**_CRC32_ZLIB), kernel_conf=conf)
    with torch.cuda.stream(stream):
        host_table = torch.empty(2 * count, dtype=torch.int64, pin_memory=True)
        table = host_table.numpy()
        table[:count] = addresses
        table[count:] = sizes
        # Device side: addresses, sizes, then the CRC values (uint32) and statuses (int32), count each.
        device_table = torch.empty(2 * count, dtype=torch.int64, device=stream.device)
        device_table.copy_(host_table, non_blocking=True)
        outputs = torch.zeros(2 * count, dtype=torch.int32, device=stream.device)
        base = device_table.data_ptr()
        _call("nvcompBatchedCRC32Async", ctypes.c_void_p(base), ctypes.c_void_p(base + 8 * count),
              ctypes.c_size_t(count), ctypes.c_void_p(outputs.data_ptr()), opts, ctypes.c_int(_CRC32_ONLY_SEGMENT),
              ctypes.c_void_p(outputs.data_ptr() + 4 * count), ctypes.c_void_p(stream.cuda_stream))  # fmt: skip
        host_results = torch.empty(2 * count, dtype=torch.int64, pin_memory=True)
        # int32 -> int64 sign-extends a CRC above 2**31: values() masks it back to 32 bits.
        host_results.copy_(outputs.to(torch.int64), non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return Crc32Batch(count=count, done=done, host_results=host_results,
                      keep_alive=[host_table, device_table, outputs])  # fmt: skip
