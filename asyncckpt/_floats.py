"""Python floats as manifest text, bit for bit.

``float.hex()`` is exact for every finite float, for both infinities and for the sign of zero,
but writes every NaN as ``"nan"``: its sign and payload (the 51 bits a NaN carries, e.g. NumPy's
``NA`` marker or a signalling NaN) would be lost. So a NaN is written as ``"nan:0x"`` followed
by its 16 hexadecimal IEEE-754 binary64 bits, and every other float as ``float.hex()``. Readers
also accept the bare ``"nan"`` that format versions 1 and 2 wrote (the default quiet NaN).
Any thread; pure functions.
"""

from __future__ import annotations

import re
import struct

_NAN_TEXT = re.compile(r"nan:0x([0-9a-f]{16})")
_EXPONENT = 0x7FF0000000000000
_FRACTION = 0x000FFFFFFFFFFFFF


def float_text(value: float) -> str:
    """The manifest text of ``value``: ``float.hex()``, or ``"nan:0x<bits>"`` for a NaN."""
    if value != value:
        return f"nan:0x{struct.unpack('<Q', struct.pack('<d', value))[0]:016x}"
    return value.hex()


def float_from_text(text: str) -> float:
    """Inverse of :func:`float_text`; ValueError for text that is neither form (or NaN bits that are not a NaN)."""
    match = _NAN_TEXT.fullmatch(text)
    if match is None:
        return float.fromhex(text)
    bits = int(match.group(1), 16)
    if bits & _EXPONENT != _EXPONENT or not bits & _FRACTION:
        raise ValueError(f"{text!r} holds the bits of a number, not of a NaN")
    value: float = struct.unpack("<d", struct.pack("<Q", bits))[0]
    return value
