"""Bit-exact comparison of training states (tensors compared as raw bytes, so NaNs match NaNs).

Used by the demo's restore check, the benchmarks and the tests; runs on the calling thread.
"""

from __future__ import annotations

import struct
from typing import Any

import torch


def clone_state(state: Any) -> Any:
    """A deep copy whose tensors live on the CPU (a reference to compare a restore against)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return type(state)((k, clone_state(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)) and type(state) in (list, tuple):
        return type(state)(clone_state(v) for v in state)
    return state


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)  # the values, not the memory
    if not flat.numel():
        return torch.empty(0, dtype=torch.uint8)
    # Dense now; a one-element tensor may still carry any stride, which view() to bytes refuses.
    return flat.as_strided((flat.numel(),), (1,)).view(torch.uint8)


def _float_bits(value: float) -> int:
    bits: int = struct.unpack("<Q", struct.pack("<d", value))[0]
    return bits


def first_difference(expected: Any, actual: Any, path: str = "") -> str | None:
    """None if equal bit for bit; else where and how they differ.

    Equal means: the same types (a tensor subclass matches a tensor: a loaded ``Parameter`` is a
    tensor), dict keys of the same types in the same order, tensors of the same dtype, shape and
    bytes, floats of the same bits (NaN payloads and the sign of zero included)."""
    where = path or "<root>"
    if type(expected) is not type(actual) and not (isinstance(expected, torch.Tensor)
                                                    and isinstance(actual, torch.Tensor)):  # fmt: skip
        return f"{where}: type {type(expected).__name__} != {type(actual).__name__}"
    if isinstance(expected, torch.Tensor):
        if expected.dtype != actual.dtype or expected.shape != actual.shape:
            return f"{where}: {expected.dtype}{tuple(expected.shape)} != {actual.dtype}{tuple(actual.shape)}"
        if not torch.equal(_bytes_of(expected), _bytes_of(actual)):
            return f"{where}: tensor bytes differ"
        return None
    if isinstance(expected, dict):
        if [(type(k), k) for k in expected] != [(type(k), k) for k in actual]:
            return f"{where}: keys {list(expected)[:8]} != {list(actual)[:8]}"
        for key in expected:
            found = first_difference(expected[key], actual[key], f"{path}/{key}")
            if found:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        if len(expected) != len(actual):
            return f"{where}: length {len(expected)} != {len(actual)}"
        for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
            found = first_difference(a, b, f"{path}/{i}")
            if found:
                return found
        return None
    if isinstance(expected, float):
        return None if _float_bits(expected) == _float_bits(actual) else f"{where}: {expected!r} != {actual!r} (bits)"
    return None if expected == actual else f"{where}: {expected!r} != {actual!r}"
