"""CPU decoder for ``deflate``: raw DEFLATE streams (RFC 1951, no zlib/gzip header) per chunk.

That is what nvCOMP's RAW Deflate writes; Python's :mod:`zlib` reads it with ``wbits=-15``.
Output is bounded by the raw size the manifest records, and a chunk must end its stream
exactly. Host buffers; runs on the calling thread (zlib releases the GIL).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from .rawchunks import decode_chunks


def _decompress(stream: bytes, raw: int) -> bytes:
    inflater = zlib.decompressobj(wbits=-15)
    try:
        # max_length 0 would mean "unlimited" to zlib: a chunk declared empty may still produce one byte.
        plain = inflater.decompress(stream, max(raw, 1))
    except zlib.error as exc:
        raise CorruptCheckpointError(f"deflate: chunk does not decode: {exc}") from exc
    if not inflater.eof or inflater.unconsumed_tail:
        raise CorruptCheckpointError(f"deflate: chunk does not end after its {raw} raw bytes")
    return plain


class DeflateDecoder:
    """Decoder for ``"deflate"`` blobs written by the GPU path."""

    def decode(
        self, blob: torch.Tensor, chunks: list[tuple[int, int]], params: Mapping[str, Any], out: torch.Tensor
    ) -> None:
        decode_chunks("deflate", _decompress, blob, chunks, params, out)
