"""One nvCOMP call over many chunks: the batched encode and decode the GPU pipeline is built on.

nvCOMP's batched API takes one buffer plus a table of byte offsets and sizes
(``nvcomp.as_arrays(buffer, offsets, sizes)``). A :class:`DeviceSpan` exposes any device address
range through ``__cuda_array_interface__``, so one batch can address chunks that live in
several allocations (the live tensors of a ``fence`` snapshot, the outputs of a restore)
without building one Python object per chunk.

RAW bitstreams throughout: each chunk is one standard frame (zstd), block (lz4) or stream
(deflate) with no nvCOMP header, so the CPU decoders read them; the manifest records every
chunk's stored and raw size, so nothing relies on sizes found inside the compressed data.

Encodes of ANS and Bitcomp go through nvCOMP's C API where :mod:`asyncckpt._gpu.native` can
load it (same bitstream; that module says why: the Python API's batch building waits for the
GPU holding the GIL); everything else through the Python API.

Threads and streams: an ``nvcomp.Codec`` must not be shared between threads, so codecs are
cached per thread (and per stream and spec). Every call enqueues its work on the stream it is
given; :meth:`PendingEncode.sizes` is where the calling thread waits for it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from . import native as native
from .deps import nvcomp
from .specs import MAX_CHUNK_BYTES, CodecSpec

OUTPUT_ALIGN_BYTES = 16
"""Start of every chunk in an output buffer: nvCOMP's strictest required buffer alignment."""

_local = threading.local()


class DeviceSpan:
    """A device address range ``[ptr, ptr + nbytes)`` seen by nvCOMP as a 1-D array of ``typestr``.

    The owner of the memory must keep it alive while nvCOMP uses the span. nvCOMP only touches
    the byte ranges of the batch built over it, never the whole span.
    """

    def __init__(self, ptr: int, nbytes: int, typestr: str = "|u1") -> None:
        itemsize = int(typestr[2:])
        self.ptr, self.nbytes, self.typestr = ptr, nbytes, typestr
        self._elements = max(1, -(-nbytes // itemsize))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self._elements,),
            "typestr": self.typestr,
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def span_of(tensors: Sequence[torch.Tensor], typestr: str = "|u1") -> tuple[DeviceSpan, int]:
    """A span covering every tensor's bytes, and its base address (offsets are relative to it)."""
    base = min(t.data_ptr() for t in tensors)
    end = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
    return DeviceSpan(base, end - base, typestr), base


def typestr_for(spec: CodecSpec) -> str:
    return spec.data_type or "|u1"


def codec_for(spec: CodecSpec, stream: torch.cuda.Stream, chunk_bytes: int) -> Any:
    """This thread's ``nvcomp.Codec`` for ``spec`` on ``stream`` (created on first use)."""
    cache: dict[tuple[CodecSpec, int, int], Any] = getattr(_local, "codecs", None) or {}
    _local.codecs = cache
    key = (spec, stream.cuda_stream, chunk_bytes)
    if key not in cache:
        nv = nvcomp()
        cache[key] = nv.Codec(
            algorithm=spec.algorithm,
            device_id=stream.device.index,
            cuda_stream=stream.cuda_stream,
            bitstream_kind=nv.BitstreamKind.RAW,
            uncomp_chunk_size=chunk_bytes,
            **spec.nvcomp_options(),
        )
    return cache[key]


def chunk_bytes_for(spec: CodecSpec, wanted: int) -> int:
    """The chunk size to use: ``wanted`` capped at the algorithm's RAW limit, a multiple of 4 KiB."""
    return max(4096, min(wanted, MAX_CHUNK_BYTES[spec.codec]) // 4096 * 4096)


def split_chunks(nbytes: int, chunk_bytes: int) -> list[int]:
    """Raw sizes of the chunks a tensor of ``nbytes`` is cut into."""
    full, rest = divmod(nbytes, chunk_bytes)
    return [chunk_bytes] * full + ([rest] if rest else [])


def _align(n: int) -> int:
    return (n + OUTPUT_ALIGN_BYTES - 1) // OUTPUT_ALIGN_BYTES * OUTPUT_ALIGN_BYTES


_max_sizes: dict[tuple[CodecSpec, int], int] = {}
_max_lock = threading.Lock()


def max_compressed_bytes(spec: CodecSpec, raw: int, codec: Any, sample: DeviceSpan) -> int:
    """nvCOMP's bound on one chunk's compressed size (cached per spec and raw size)."""
    key = (spec, raw)
    with _max_lock:
        if key not in _max_sizes:
            view = DeviceSpan(sample.ptr, raw, sample.typestr)
            _max_sizes[key] = int(codec.get_max_comp_buffer_size(nvcomp().as_array(view)))
        return _max_sizes[key]


@dataclass
class PendingEncode:
    """One batched encode in flight on a stream; its inputs and outputs are kept alive here."""

    spec: CodecSpec
    raw_sizes: list[int]
    out: torch.Tensor
    out_offsets: list[int]
    result: Any
    keep_alive: list[Any] = field(default_factory=list)
    began: torch.cuda.Event | None = None
    ended: torch.cuda.Event | None = None
    done: torch.cuda.Event | None = None
    """Recorded after the encode on its stream (``ended`` itself when timed)."""
    c_api: native.NativeEncode | None = None
    """The C-API encode, when it ran through :mod:`asyncckpt._gpu.native` (``result`` is then None)."""
    _sizes: list[int] | None = None

    def sizes(self) -> list[int]:
        """Compressed size of every chunk; blocks the calling thread until the encode is done."""
        if self._sizes is None and self.c_api is not None:
            self._sizes = self.c_api.sizes()
        if self._sizes is None:
            if self.done is not None:
                # Wait here, where torch lets go of the GIL: nvCOMP's `buffer_sizes` may wait for
                # the GPU holding it, and the training thread needs the GIL to launch kernels.
                self.done.synchronize()
            self._sizes = [int(n) for n in self.result.buffer_sizes]
            if len(self._sizes) != len(self.raw_sizes):
                raise RuntimeError(f"nvCOMP returned {len(self._sizes)} sizes for {len(self.raw_sizes)} chunks")
        return self._sizes

    def gpu_seconds(self) -> float:
        if self.began is None or self.ended is None:
            return 0.0
        self.ended.synchronize()
        return self.began.elapsed_time(self.ended) / 1e3


def encode(
    spec: CodecSpec,
    span: DeviceSpan,
    offsets: Sequence[int] | np.ndarray,
    raw_sizes: Sequence[int] | np.ndarray,
    stream: torch.cuda.Stream,
    chunk_bytes: int,
    keep_alive: list[Any],
    timed: bool = True,
) -> PendingEncode:
    """Enqueue one batched encode of the chunks ``span[offsets[i] : offsets[i] + raw_sizes[i]]``.

    Runs on the calling thread; all GPU work goes on ``stream``; nothing here waits for the GPU.
    """
    raw = np.asarray(raw_sizes, dtype=np.int64)
    largest = max(chunk_bytes, int(raw.max())) if raw.size else chunk_bytes
    if native.available(spec):
        began = ended = None
        if timed:
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sources = span.ptr + np.asarray(offsets, dtype=np.int64)
        job = native.encode(spec, sources, raw, largest, stream, began, ended)
        return PendingEncode(
            spec=spec,
            raw_sizes=raw.tolist(),
            out=job.out,
            out_offsets=job.out_offsets,
            result=None,
            keep_alive=[*keep_alive, span],
            began=began,
            ended=ended,
            done=job.done,
            c_api=job,
        )
    nv = nvcomp()
    codec = codec_for(spec, stream, chunk_bytes)
    # nvCOMP checks every output against the bound of a full chunk (its configured chunk size),
    # whatever the size of that chunk's input, so tails get a full chunk's room too.
    bound = _align(max_compressed_bytes(spec, largest, codec, span))
    bounds = [bound] * raw.size
    out_offsets = [i * bound for i in range(raw.size)]
    total = bound * raw.size
    with torch.cuda.stream(stream):
        out = torch.empty(max(total, 1), dtype=torch.uint8, device=stream.device)
        began = ended = None
        if timed:
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record(stream)
        sources = nv.as_arrays(span, np.asarray(offsets).tolist(), raw.tolist(), cuda_stream=stream.cuda_stream)
        outputs = nv.as_arrays(
            DeviceSpan(out.data_ptr(), out.numel()), out_offsets, bounds, cuda_stream=stream.cuda_stream
        )
        result = codec.encode(sources, out=outputs)
        done = ended if ended is not None else torch.cuda.Event()
        done.record(stream)
    return PendingEncode(
        spec=spec,
        raw_sizes=raw.tolist(),
        out=out,
        out_offsets=out_offsets,
        result=result,
        keep_alive=[*keep_alive, sources, outputs, span],
        began=began,
        ended=ended,
        done=done,
    )


def decode(
    spec: CodecSpec,
    src: DeviceSpan,
    src_offsets: list[int],
    stored: list[int],
    dst: DeviceSpan,
    dst_offsets: list[int],
    raw: list[int],
    stream: torch.cuda.Stream,
) -> None:
    """Decode a batch of chunks into ``dst`` and check every decoded size; blocks until done.

    Raises CorruptCheckpointError when a chunk does not decode or decodes to another size.
    """
    if not stored:
        return
    nv = nvcomp()
    largest = max(raw)
    if largest > MAX_CHUNK_BYTES[spec.codec]:
        raise CorruptCheckpointError(
            f"a {spec.codec} chunk of {largest} raw bytes exceeds nvCOMP's limit of {MAX_CHUNK_BYTES[spec.codec]}"
        )
    chunk_bytes = 65536
    while chunk_bytes < largest:
        chunk_bytes *= 2
    codec = codec_for(spec, stream, min(chunk_bytes, MAX_CHUNK_BYTES[spec.codec]))
    try:
        sources = nv.as_arrays(src, src_offsets, stored, cuda_stream=stream.cuda_stream)
        outputs = nv.as_arrays(dst, dst_offsets, raw, cuda_stream=stream.cuda_stream)
        result = codec.decode(sources, out=outputs)
        sizes = [int(n) for n in result.buffer_sizes]
    except (RuntimeError, ValueError) as exc:
        raise CorruptCheckpointError(f"nvCOMP {spec} could not decode a chunk: {exc}") from exc
    bad = [(i, got, want) for i, (got, want) in enumerate(zip(sizes, raw, strict=True)) if got != want]
    if bad:
        i, got, want = bad[0]
        raise CorruptCheckpointError(f"nvCOMP {spec}: chunk {i} decoded to {got} bytes, expected {want}")


_alignments: dict[CodecSpec, int] = {}


def required_alignment(spec: CodecSpec, stream: torch.cuda.Stream, chunk_bytes: int) -> int:
    """nvCOMP's alignment requirement for the input chunks of ``spec`` (bytes)."""
    if spec not in _alignments:
        _alignments[spec] = max(1, int(codec_for(spec, stream, chunk_bytes).get_required_compression_alignment()))
    return _alignments[spec]


_dec_alignments: dict[CodecSpec, int] = {}


def required_decode_alignment(spec: CodecSpec, stream: torch.cuda.Stream) -> int:
    """nvCOMP's alignment requirement for the compressed chunks fed to a decode of ``spec`` (bytes)."""
    if spec not in _dec_alignments:
        codec = codec_for(spec, stream, 65536)
        _dec_alignments[spec] = max(1, int(codec.get_required_decompression_alignment()))
    return _dec_alignments[spec]
