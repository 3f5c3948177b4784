"""Checksums of stored blobs, verified on every load.

Two algorithms, named in the manifest next to each value:

``crc32``
    zlib's CRC-32 of the stored bytes; what both paths write (here with zlib, ~2 GB/s on one
    core, releasing the GIL; on the GPU with nvCOMP, :mod:`asyncckpt._gpu.checksum`).
``mix64``
    Read only: what the GPU path wrote until 2026-12-05. Sum modulo 2**64 of a splitmix64
    finaliser applied to every little-endian 64-bit word XOR-ed with its position (the tail
    zero-padded), XOR the byte length.

Neither is cryptographic: they detect corruption, not tampering (a manifest is trusted to be
the writer's, but never trusted to be well-formed).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
import torch

from .errors import CorruptCheckpointError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_BLOCK_WORDS = 1 << 20  # bounds the temporaries to 8 MiB per pass


def crc32_host(buf: np.ndarray) -> str:
    return f"{zlib.crc32(buf.data) & 0xFFFFFFFF:08x}"


def mix64_host(buf: np.ndarray) -> str:
    pad = (-buf.size) % 8
    words = (np.concatenate([buf, np.zeros(pad, np.uint8)]) if pad else buf).view("<u8")
    total = np.uint64(0)
    positions = np.arange(_BLOCK_WORDS, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for start in range(0, words.size, _BLOCK_WORDS):
            block = words[start : start + _BLOCK_WORDS]
            x = block ^ ((positions[: block.size] + np.uint64(start)) * _GOLDEN)
            x ^= x >> np.uint64(30)
            x *= _M1
            x ^= x >> np.uint64(27)
            x *= _M2
            x ^= x >> np.uint64(31)
            total += x.sum(dtype=np.uint64)
    return f"{int(total) ^ buf.size:016x}"


HOST_ALGORITHMS: dict[str, Callable[[np.ndarray], str]] = {"crc32": crc32_host, "mix64": mix64_host}


def compute(algorithm: str, buf: torch.Tensor) -> str:
    """Checksum of a 1-D uint8 buffer as a hex string. Host buffers only; runs on the caller's thread."""
    if buf.device.type != "cpu":
        raise ValueError("host checksum of a device buffer; asyncckpt._gpu.checksum computes crc32 on the device")
    return HOST_ALGORITHMS[algorithm](buf.numpy())


def verify_value(algorithm: str, expected: str, actual: str, where: str) -> None:
    """Raise CorruptCheckpointError naming ``where`` (tensor and file) if the checksums differ."""
    if actual != expected:
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch ({algorithm} stored {expected}, computed {actual}); "
            "the file is corrupt. Load an earlier checkpoint with step=..."
        )


def check_algorithm(name: object, where: str) -> str:
    if name not in HOST_ALGORITHMS:
        raise CorruptCheckpointError(f"{where}: unknown checksum algorithm {name!r} (known: {sorted(HOST_ALGORITHMS)})")
    assert isinstance(name, str)
    return name
