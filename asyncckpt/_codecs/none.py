"""The identity codec: bytes stored as they are, one chunk.

Used when compression is switched off and as the fallback for a tensor that would not shrink
(random bytes, already-compressed data): storing it raw costs no decode time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from .base import EncodedBlob, PerTensorEncoder


class NoneCodec(PerTensorEncoder):
    """Encoder and decoder for ``"none"``; works on host and device buffers alike."""

    name = "none"

    def encode(self, raw: torch.Tensor, dtype: torch.dtype, key: str) -> EncodedBlob:
        return EncodedBlob(data=raw, codec="none", chunks=[(raw.numel(), raw.numel())])

    def decode(
        self, blob: torch.Tensor, chunks: list[tuple[int, int]], params: Mapping[str, Any], out: torch.Tensor
    ) -> None:
        if blob.numel() != out.numel():
            raise CorruptCheckpointError(f"stored {blob.numel()} bytes for a raw size of {out.numel()}")
        out.copy_(blob)
