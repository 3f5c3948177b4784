"""The codec plug-in interface.

A codec turns the raw bytes of one tensor into a blob of independently decodable chunks and
back. Chunks exist because nvCOMP's batched GPU codecs cap a chunk's size (16 MiB for ANS in
RAW mode) and because independent chunks let the CPU codec use every core. A blob is the
chunks back to back; the manifest records each chunk's stored and raw size, so a decoder
never has to trust a length found inside the compressed data.

Buffers are 1-D ``torch.uint8`` tensors on the CPU or on a CUDA device, so one interface
serves the CPU codecs (host buffers) and nvCOMP (device buffers) alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from .._snapshot.base import Snapshot

CPU_CODECS = ("none", "zstd", "lz4", "deflate")
"""Codec names a CPU-only machine can decode."""

GPU_ONLY_CODECS = frozenset({"ans", "gdeflate", "bitcomp", "cascaded"})
"""nvCOMP formats with no CPU decoder: reading them needs a GPU and the GPU extra."""


@dataclass(frozen=True)
class EncodedBlob:
    """One tensor's stored form."""

    data: torch.Tensor
    """1-D uint8, the chunks back to back (host or device memory)."""
    codec: str
    """The manifest name of the codec that produced it (``"none"``, ``"zstd"``, ...)."""
    chunks: list[tuple[int, int]]
    """``(stored_bytes, raw_bytes)`` per chunk, in order."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Codec parameters that decoding needs, written to the manifest (JSON values only)."""
    delta: str | None = None
    """None, or the :data:`~asyncckpt._delta_ops.DELTA_OPS` op whose output the chunks encode: the
    record's ``delta`` (format version 4; set by :mod:`asyncckpt._delta_encode`, never by a codec)."""
    crc32: str | None = None
    """zlib's CRC-32 of :attr:`data` as 8 hex digits, when the encoder computed it where the bytes
    were made (the GPU pipeline, one batched launch per group); None: the writer computes it."""

    @property
    def stored_bytes(self) -> int:
        return int(self.data.numel())


class Encoder(Protocol):
    """Compresses tensors for one checkpointer; used by its worker thread only."""

    name: str
    batched: bool
    """True when :meth:`encode_snapshot` compresses a whole snapshot in batches ahead of the writer
    and takes the delta decisions itself (the GPU pipeline); False when it encodes one tensor at a
    time and the writer takes them (:class:`PerTensorEncoder`)."""

    def encode(self, raw: torch.Tensor, dtype: torch.dtype, key: str) -> EncodedBlob:
        """Encode ``raw`` (1-D uint8, the bytes of a tensor of ``dtype``) stored under ``key``.

        Runs on the checkpoint worker thread. ``raw`` must not be modified.
        """
        ...

    def encode_snapshot(self, snapshot: Snapshot) -> Iterator[EncodedBlob]:
        """The blobs of ``snapshot.tensors``, in order. Worker thread (the iterator is consumed there)."""
        ...

    def close(self) -> None:
        """Free what the encoder holds (threads, device memory). The checkpointer's close()."""
        ...


class PerTensorEncoder:
    """The :class:`Encoder` parts every CPU codec shares: one tensor at a time, nothing to free."""

    batched = False

    def encode(self, raw: torch.Tensor, dtype: torch.dtype, key: str) -> EncodedBlob:
        raise NotImplementedError

    def encode_snapshot(self, snapshot: Snapshot) -> Iterator[EncodedBlob]:
        return (self.encode(t.data, t.dtype, t.key) for t in snapshot.tensors)

    def close(self) -> None:
        pass


class Decoder(Protocol):
    """Decodes blobs of one codec name."""

    def decode(
        self, blob: torch.Tensor, chunks: list[tuple[int, int]], params: Mapping[str, Any], out: torch.Tensor
    ) -> None:
        """Decode ``blob`` into ``out`` (1-D uint8 of exactly the raw size, same device kind).

        Raises ``CorruptCheckpointError`` (without location; the caller adds it) if a chunk
        does not decode to exactly its recorded raw size.
        """
        ...
