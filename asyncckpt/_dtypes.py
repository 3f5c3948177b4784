"""The mapping between torch dtypes and the names written into a manifest.

Names are torch's own (``"bfloat16"``, ``"float8_e4m3fn"``); a manifest that names a dtype
this torch does not have is rejected on load with a clear error. Bytes are always stored
little-endian, the byte order of every platform torch supports for training.
"""

from __future__ import annotations

import torch

from .errors import CorruptCheckpointError

_CANDIDATE_NAMES = (
    "bool",
    "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64",
    "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
)  # fmt: skip

# Only the dtypes this torch build actually has (older builds lack some float8 kinds).
DTYPE_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _CANDIDATE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
NAME_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}

# Floating-point dtypes whose bytes compress better split into byte planes (sign/exponent
# bytes are far more regular than mantissa bytes).
FLOATING_NAMES = frozenset(name for name, dtype in DTYPE_BY_NAME.items() if dtype.is_floating_point or dtype.is_complex)


def dtype_name(dtype: torch.dtype) -> str | None:
    """The manifest name of ``dtype``, or None if asyncckpt cannot store it."""
    return NAME_BY_DTYPE.get(dtype)


def dtype_from_name(name: object, where: str) -> torch.dtype:
    """The torch dtype a manifest names; raises CorruptCheckpointError naming ``where``."""
    if not isinstance(name, str) or name not in DTYPE_BY_NAME:
        raise CorruptCheckpointError(f"{where}: unknown dtype {name!r} (this torch knows {sorted(DTYPE_BY_NAME)})")
    return DTYPE_BY_NAME[name]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element."""
    return dtype.itemsize
