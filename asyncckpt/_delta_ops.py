"""Lossless byte transforms of a tensor against its previous version (incremental checkpoints).

A delta checkpoint stores, for a tensor, ``encode_delta(new, reference)`` instead of ``new``, where
``reference`` is the same key's raw bytes in the previous checkpoint; the codec then compresses
the transformed bytes, which are mostly small numbers when training changed the tensor little.
``decode_delta(stored, reference)`` gives ``new`` back bit for bit, always (NaN payloads, -0.0,
denormals included): both ops work on the integer bit patterns, never on values.

Ops (the manifest's per-record ``delta``):

* ``xor``: bitwise XOR of the bytes viewed as integers of the element width;
* ``sub``: wrapping integer difference at the element width, mapped through zigzag
  (``(d << 1) ^ (d >> (w - 1))``), so a small negative difference is a small number too.

The element width ``w`` is the dtype's item size, except for complex dtypes (the width of one
component: real and imaginary parts drift separately). ``bool`` and 1-byte dtypes use 8 bits.

Functions take and return 1-D ``torch.uint8`` tensors on any device (CPU or CUDA) and use
torch only, so the host loader and the GPU path share them. Signed integer arithmetic here
wraps (two's complement), which torch's CPU and CUDA kernels do; the property tests check it
bit for bit for every dtype. Runs on the calling thread (and, for CUDA tensors, the current stream).
"""

from __future__ import annotations

import torch

__all__ = ["DELTA_OPS", "decode_delta", "element_width", "encode_delta"]

DELTA_OPS = ("xor", "sub")
"""The transforms a manifest may name (format version 4, per-record ``delta``)."""

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def element_width(dtype: torch.dtype) -> int:
    """Bytes per integer lane of ``dtype`` for the delta ops (a complex dtype's component width)."""
    size = dtype.itemsize
    return size // 2 if dtype.is_complex else size


def _lanes(raw: torch.Tensor, width: int, where: str) -> torch.Tensor:
    """``raw`` (1-D uint8) as signed integers of ``width`` bytes, a view when its alignment allows."""
    if raw.dim() != 1 or raw.dtype != torch.uint8:
        raise ValueError(f"{where}: expected a 1-D uint8 tensor, got {raw.dtype} of shape {tuple(raw.shape)}")
    if raw.numel() % width:
        raise ValueError(f"{where}: {raw.numel()} bytes are not a whole number of {width}-byte elements")
    if not raw.is_contiguous() or raw.storage_offset() % width:
        raw = raw.clone()  # view(dtype) needs an element-aligned offset
    return raw.view(_SIGNED[width])


def _check(raw: torch.Tensor, reference: torch.Tensor, op: str) -> None:
    if op not in DELTA_OPS:
        raise ValueError(f"unknown delta op {op!r} (known: {', '.join(DELTA_OPS)})")
    if raw.numel() != reference.numel() or raw.device != reference.device:
        raise ValueError(f"delta of {raw.numel()} bytes on {raw.device} against a reference of "
                         f"{reference.numel()} bytes on {reference.device}")  # fmt: skip


def encode_delta(raw: torch.Tensor, reference: torch.Tensor, op: str, dtype: torch.dtype) -> torch.Tensor:
    """The bytes to store for ``raw`` against ``reference`` (both the raw bytes of a ``dtype`` tensor).

    Returns a new 1-D uint8 tensor on their device; neither input is modified.
    """
    _check(raw, reference, op)
    width = element_width(dtype)
    new, ref = _lanes(raw, width, "encode_delta"), _lanes(reference, width, "encode_delta reference")
    if op == "xor":
        out = torch.bitwise_xor(new, ref)
    else:
        diff = torch.sub(new, ref)  # wraps at the width
        out = torch.bitwise_xor(torch.bitwise_left_shift(diff, 1), torch.bitwise_right_shift(diff, 8 * width - 1))
    return out.view(torch.uint8)


def decode_delta(stored_raw: torch.Tensor, reference: torch.Tensor, op: str, dtype: torch.dtype) -> torch.Tensor:
    """Invert :func:`encode_delta`: the original raw bytes, computed in place in ``stored_raw`` when it
    is element-aligned (returned either way). ``reference`` is not modified."""
    _check(stored_raw, reference, op)
    width = element_width(dtype)
    lanes, ref = _lanes(stored_raw, width, "decode_delta"), _lanes(reference, width, "decode_delta reference")
    if op == "xor":
        lanes.bitwise_xor_(ref)
    else:
        sign = torch.bitwise_and(lanes, 1).neg_()  # 0 or -1: the zigzag sign bit
        # Logical shift right by one: arithmetic shift, then clear the copied sign bit.
        lanes.bitwise_right_shift_(1).bitwise_and_((1 << (8 * width - 1)) - 1)
        lanes.bitwise_xor_(sign).add_(ref)  # the difference, plus the reference, wrapping
    return lanes.view(torch.uint8)
