"""Byte-plane split ("shuffle") of fixed-width elements.

Element bytes ``[a0 a1 a2 a3][b0 b1 b2 b3]...`` become planes ``a0 b0 ... | a1 b1 ... |``.
Float exponents and signs live in a few bytes that vary little between neighbours, so the
planes compress far better than interleaved bytes (FP32 gradients produced under BF16 autocast
compress ~2.6x split, ~1.15x unsplit: their low bytes are near-constant). Host memory only.
"""

from __future__ import annotations

import numpy as np


def split(raw: np.ndarray, planes: int) -> np.ndarray:
    """Return the planes of ``raw`` (uint8, length a multiple of ``planes``) as a new array."""
    if planes == 1:
        return raw
    return np.ascontiguousarray(raw.reshape(-1, planes).T).reshape(-1)


def join(planar: np.ndarray, planes: int, out: np.ndarray) -> None:
    """Inverse of :func:`split`, writing into ``out`` (uint8, same length)."""
    if planes == 1:
        out[:] = planar
        return
    out.reshape(-1, planes)[:] = planar.reshape(planes, -1).T
