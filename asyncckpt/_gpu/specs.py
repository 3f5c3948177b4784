"""Which nvCOMP configuration encodes a tensor: codec name, nvCOMP data type, byte planes.

A :class:`CodecSpec` is everything a decoder needs besides the chunk sizes, and it is what the
manifest records (``codec`` plus ``codec_params``). Byte planes use the layout of the CPU zstd
codec (:mod:`asyncckpt._codecs.planes`), applied per chunk, so a checkpoint that a GPU wrote
with ``zstd``, ``lz4`` or ``deflate`` decodes on a CPU-only machine.

The float-aware ANS data types take the bit patterns as they are: BF16 goes in as ``<f2``
(its bits viewed as float16, never converted), FP32 as ``<f4``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._codecs.base import CPU_CODECS
from .._dtypes import FLOATING_NAMES, dtype_name
from ..errors import CorruptCheckpointError

ALGORITHMS = {
    "ans": "ANS",
    "zstd": "Zstd",
    "lz4": "LZ4",
    "deflate": "Deflate",
    "gdeflate": "GDeflate",
    "bitcomp": "Bitcomp",
    "cascaded": "Cascaded",
}
"""Manifest codec name -> nvCOMP algorithm name."""

MAX_CHUNK_BYTES = {
    "ans": 16 << 20,
    "zstd": 16 << 20,
    "lz4": 16 << 20,
    "deflate": 64 << 10,
    "gdeflate": 64 << 10,
    "bitcomp": 16 << 20,
    "cascaded": 16 << 20,
}
"""nvCOMP's limit on one RAW chunk's uncompressed size, per algorithm (a RAW buffer is one chunk)."""

PLANED_CODECS = frozenset({"zstd", "lz4", "deflate", "gdeflate"})
"""Byte-oriented codecs that always split float tensors into byte planes first (as the CPU zstd codec does)."""

_DATA_TYPES = frozenset({"", "|u1", "|i1", "<f2", "<f4", "<f8", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8"})


@dataclass(frozen=True)
class CodecSpec:
    codec: str
    """Manifest codec name (a key of :data:`ALGORITHMS`)."""
    data_type: str = ""
    """nvCOMP ``data_type`` ('' when the algorithm takes none)."""
    planes: int = 1
    """Byte planes each chunk is split into before encoding (1: none)."""
    planes_span: str = "chunk"
    """What a plane spans: ``"chunk"`` (each chunk split on its own: the CPU codecs' layout) or
    ``"tensor"`` (the whole tensor split once, then cut into chunks, so nearly every chunk holds
    one plane and gets its own ANS table: a plane of constant bytes then costs almost nothing,
    where mixed with the other planes in one chunk it shares their table). GPU-only."""

    @property
    def algorithm(self) -> str:
        return ALGORITHMS[self.codec]

    def params(self) -> dict[str, Any]:
        """The manifest's ``codec_params``."""
        out: dict[str, Any] = {"planes": self.planes}
        if self.planes_span != "chunk":  # written only when used: byte planes per chunk read as before
            out["planes_span"] = self.planes_span
        if self.data_type:
            out["data_type"] = self.data_type
        return out

    def nvcomp_options(self) -> dict[str, Any]:
        return {"data_type": self.data_type} if self.data_type else {}

    def __str__(self) -> str:
        span = "t" if self.planes_span == "tensor" else ""
        return f"{self.codec}[{self.data_type or '-'}]/p{self.planes}{span}"


def spec_from_manifest(codec: str, params: Mapping[str, Any], where: str) -> CodecSpec:
    """The spec a manifest record names; rejects anything malformed (hostile input)."""
    if codec not in ALGORITHMS:
        raise CorruptCheckpointError(f"{where}: {codec!r} is not an nvCOMP codec")
    planes = params.get("planes", 1)
    planes_span = params.get("planes_span", "chunk")
    data_type = params.get("data_type", "")
    if type(planes) is not int or planes not in (1, 2, 4, 8, 16):
        raise CorruptCheckpointError(f"{where}: invalid planes parameter {planes!r}")
    if planes_span not in ("chunk", "tensor"):
        raise CorruptCheckpointError(f"{where}: invalid planes_span parameter {planes_span!r}")
    if planes_span == "tensor" and (planes == 1 or codec in CPU_CODECS):
        # Never written so: a GPU would read it and a CPU (which knows per-chunk planes only) would not.
        raise CorruptCheckpointError(f"{where}: planes_span 'tensor' with {codec} and {planes} planes")
    if not isinstance(data_type, str) or data_type not in _DATA_TYPES:
        raise CorruptCheckpointError(f"{where}: invalid data_type parameter {data_type!r}")
    return CodecSpec(codec, data_type, planes, planes_span)


def _is_float(dtype: torch.dtype) -> bool:
    return dtype_name(dtype) in FLOATING_NAMES


def _int_type(itemsize: int, signed: bool) -> str:
    return "|u1" if itemsize == 1 else f"<{'i' if signed else 'u'}{itemsize}"


def spec_for(codec: str, dtype: torch.dtype) -> CodecSpec:
    """The spec that ``codec="<name>"`` uses for tensors of ``dtype``."""
    size = dtype.itemsize
    floating = _is_float(dtype)
    if codec == "ans":
        # Float-aware ANS for 16/32-bit floats; bytes for everything else.
        return CodecSpec("ans", {2: "<f2", 4: "<f4"}.get(size, "|u1") if floating else "|u1")
    if codec == "bitcomp":
        if floating and size in (2, 4, 8):
            return CodecSpec("bitcomp", f"<f{size}")
        return CodecSpec("bitcomp", _int_type(size, dtype.is_signed) if size in (1, 2, 4, 8) else "|u1")
    if codec == "cascaded":
        # Cascaded works on integers: floats are coded as unsigned words of their width.
        return CodecSpec(
            "cascaded", _int_type(size, dtype.is_signed and not floating) if size in (1, 2, 4, 8) else "|u1"
        )
    if codec in PLANED_CODECS:
        return CodecSpec(codec, "", size if floating and size in (2, 4, 8, 16) else 1)
    raise ValueError(f"{codec!r} is not an nvCOMP codec (known: {', '.join(sorted(ALGORITHMS))})")


def auto_candidates(dtype: torch.dtype) -> tuple[CodecSpec, ...]:
    """The cheap candidates ``codec="auto"`` tries on a tensor of ``dtype``, best guess first.

    Only codecs that run at a few hundred GB/s on an H200 (ANS, Bitcomp; Cascaded for integers):
    the whole point of compressing on the GPU is that it hides behind storage. Floats get ANS
    with the float-aware type on whole words, ANS on byte planes that span the tensor, and
    Bitcomp on whole words. Planes span the tensor, not each chunk, because that is what lets
    ANS match nvCOMP Zstd on real state (figures: docs/benchmarks.md, "Why the GPU path is built
    this way"). Zstd, LZ4, Deflate and GDeflate are tens of times slower and stay explicit choices.
    """
    size = dtype.itemsize
    floating = _is_float(dtype)
    if floating and size in (2, 4):
        return (CodecSpec("ans", f"<f{size}"), CodecSpec("ans", "|u1", size, "tensor"), spec_for("bitcomp", dtype))
    candidates = [CodecSpec("ans", "|u1")]
    if size in (2, 4, 8, 16):
        candidates.append(CodecSpec("ans", "|u1", size, "tensor"))
    if size in (1, 2, 4, 8):
        candidates.append(spec_for("bitcomp", dtype))
        if not floating:
            candidates.append(spec_for("cascaded", dtype))
    return tuple(candidates)
