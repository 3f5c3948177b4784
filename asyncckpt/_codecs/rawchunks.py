"""Host decoding of chunked blobs in a standard per-chunk format, with the byte-plane layout.

The GPU pipeline writes ``lz4`` and ``deflate`` blobs as nvCOMP RAW chunks: each chunk is one
LZ4 block or one raw DEFLATE stream of the chunk's bytes, split into byte planes first for
float tensors (``planes`` in the manifest, the layout of :mod:`.planes`). This module walks the
chunk table, checks every size against the manifest, and joins the planes; the codec modules
supply only the per-chunk decompression. Runs on the calling thread; host memory only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from . import planes as byte_planes

ChunkDecoder = Callable[[bytes, int], bytes]
"""Decompress one chunk given its stored bytes and the raw size recorded for it; raise
CorruptCheckpointError if it does not decode."""


def checked_planes(codec: str, params: Mapping[str, Any]) -> int:
    """The ``planes`` parameter of a manifest record, validated (hostile input)."""
    planes = params.get("planes", 1)
    if type(planes) is not int or planes not in (1, 2, 4, 8, 16):
        raise CorruptCheckpointError(f"{codec}: invalid planes parameter {planes!r}")
    if params.get("planes_span", "chunk") != "chunk":  # tensor-wide planes are a GPU-only layout (ANS)
        raise CorruptCheckpointError(f"{codec}: invalid planes_span parameter {params['planes_span']!r}")
    return planes


def chunk_views(
    codec: str, src: np.ndarray, dst: np.ndarray, chunks: list[tuple[int, int]], planes: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(stored bytes, raw output)`` views per chunk, after checking every size against the buffers."""
    views, stored_at, raw_at = [], 0, 0
    for stored, raw in chunks:
        if raw % planes:
            raise CorruptCheckpointError(f"{codec}: chunk of {raw} bytes is not a whole number of {planes}-byte items")
        views.append((src[stored_at : stored_at + stored], dst[raw_at : raw_at + raw]))
        stored_at, raw_at = stored_at + stored, raw_at + raw
    if stored_at != src.size or raw_at != dst.size:
        raise CorruptCheckpointError(
            f"{codec}: chunk sizes do not add up to the blob ({stored_at} of {src.size} "
            f"stored, {raw_at} of {dst.size} raw bytes)"
        )
    return views


def decode_chunks(
    codec: str,
    decompress: ChunkDecoder,
    blob: torch.Tensor,
    chunks: list[tuple[int, int]],
    params: Mapping[str, Any],
    out: torch.Tensor,
) -> None:
    planes = checked_planes(codec, params)
    if blob.device.type != "cpu" or out.device.type != "cpu":
        raise ValueError(f"the {codec} CPU decoder takes host buffers")
    for stored, raw in chunk_views(codec, blob.numpy(), out.numpy(), chunks, planes):
        plain = decompress(stored.tobytes(), raw.size)
        if len(plain) != raw.size:
            raise CorruptCheckpointError(f"{codec}: chunk decoded to {len(plain)} bytes, expected {raw.size}")
        byte_planes.join(np.frombuffer(plain, dtype=np.uint8), planes, raw)
