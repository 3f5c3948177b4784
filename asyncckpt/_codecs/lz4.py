"""CPU decoder for ``lz4``: LZ4 block format chunks (nvCOMP RAW), raw size from the manifest.

A RAW LZ4 chunk carries no size header; the manifest records each chunk's raw size, and
decompression is bounded by it. Needs the ``lz4`` package (in the GPU extras and ``[test]``),
imported on first use. Host buffers; runs on the calling thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpointError, MissingDependencyError
from .rawchunks import decode_chunks


def _decompress(frame: bytes, raw: int) -> bytes:
    try:
        import lz4.block
    except ImportError as exc:
        raise MissingDependencyError(f"decoding lz4 blobs needs the lz4 package ({exc}): pip install lz4") from exc
    try:
        return bytes(lz4.block.decompress(frame, uncompressed_size=raw))
    except lz4.block.LZ4BlockError as exc:
        raise CorruptCheckpointError(f"lz4: chunk does not decode: {exc}") from exc


class Lz4Decoder:
    """Decoder for ``"lz4"`` blobs written by the GPU path."""

    def decode(
        self, blob: torch.Tensor, chunks: list[tuple[int, int]], params: Mapping[str, Any], out: torch.Tensor
    ) -> None:
        decode_chunks("lz4", _decompress, blob, chunks, params, out)
