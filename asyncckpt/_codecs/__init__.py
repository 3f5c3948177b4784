"""Codecs: which encoder compresses a tensor, and which decoder reads a blob back.

Encoders on the CPU path: ``none`` and ``zstd`` (byte planes + Zstandard); the GPU path's are
:mod:`asyncckpt._gpu`'s. Decoders come from one registry (:data:`_DECODERS`) that names each
codec's implementation and imports it on first use; a manifest that names a codec this machine
cannot decode fails with an error that says what to install.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence

from ..errors import CheckpointError, CorruptCheckpointError, gpu_extra_hint
from .base import CPU_CODECS, GPU_ONLY_CODECS, Decoder, EncodedBlob, Encoder, PerTensorEncoder
from .none import NoneCodec
from .zstd import ZstdCodec

__all__ = ["Decoder", "EncodedBlob", "Encoder", "NoneCodec", "PerTensorEncoder", "ZstdCodec", "get_decoder",
           "GPU_ONLY_CODECS", "CPU_CODECS", "MAX_EXPANSION", "check_expansion"]  # fmt: skip


MAX_EXPANSION: dict[str, tuple[int, int]] = {"none": (1, 0), "zstd": (1 << 15, 0), "lz4": (256, 64),
                                              "deflate": (1040, 1024)}  # fmt: skip
"""Per codec ``(a, b)``: a chunk of ``s`` stored bytes never decodes to more than ``a * s + b`` bytes.

The formats' own limits: a Zstandard block holds at most 128 KiB and takes at least 4 bytes (an
RLE block); an LZ4 sequence adds at most 255 bytes of match per byte; DEFLATE at most 258 bytes
per 2 bits (1032:1). A manifest that claims more is corrupt, and is refused before anything is
allocated, so what a reader allocates is bounded by the bytes the file really holds."""

_DECODERS: dict[str, tuple[str, str]] = {
    "none": ("asyncckpt._codecs.none", "NoneCodec"),
    "zstd": ("asyncckpt._codecs.zstd", "ZstdCodec"),
    "lz4": ("asyncckpt._codecs.lz4", "Lz4Decoder"),
    "deflate": ("asyncckpt._codecs.deflate", "DeflateDecoder"),
    **{name: ("asyncckpt._gpu.decoders", "NvcompDecoder") for name in GPU_ONLY_CODECS},
}
"""The registry: each codec name a manifest may hold, and the module and class that decode it,
imported on first use (a reader of zstd checkpoints never imports lz4, nvCOMP or CuPy). A GPU
decoder class takes the codec name; a CPU one takes no argument."""
_decoders: dict[str, Decoder] = {}
_lock = threading.Lock()


def get_decoder(name: object, where: str) -> Decoder:
    """The decoder for a codec named in a manifest; ``where`` locates it in error messages. Any thread."""
    if not isinstance(name, str):
        raise CorruptCheckpointError(f"{where}: codec name is not a string: {name!r}")
    if name not in _DECODERS:
        raise CorruptCheckpointError(f"{where}: unknown codec {name!r} (known: {sorted(_DECODERS)})")
    with _lock:
        if name not in _decoders:
            _decoders[name] = _build_decoder(name, where)
        return _decoders[name]


def _build_decoder(name: str, where: str) -> Decoder:
    module_name, class_name = _DECODERS[name]
    if name in GPU_ONLY_CODECS:
        from .._gpu.deps import gpu_path_available  # cheap: nothing optional is imported without CUDA

        if not gpu_path_available():
            raise CheckpointError(
                f"{where}: codec {name!r} is an nvCOMP GPU format and needs a CUDA GPU with the GPU extra to "
                f"decode:\n{gpu_extra_hint()}\nOr convert the checkpoint on a GPU machine: "
                "asyncckpt convert CKPT OUT --codec zstd"
            )
        return getattr(importlib.import_module(module_name), class_name)(name)
    return getattr(importlib.import_module(module_name), class_name)()


def check_expansion(codec: str, chunks: Sequence[tuple[int, int]], where: str) -> None:
    """Raise CorruptCheckpointError if a chunk claims more raw bytes than ``codec`` can produce from it.

    Codecs without a known bound (the GPU-only nvCOMP formats) pass. Costs one step per chunk.
    """
    bound = MAX_EXPANSION.get(codec)
    if bound is None:
        return
    a, b = bound
    for i, (stored, raw) in enumerate(chunks):
        if raw > a * stored + b:
            raise CorruptCheckpointError(
                f"{where}: chunk {i} claims {raw} raw bytes from {stored} stored bytes, more than {codec} can "
                "decode to; the manifest is corrupt"
            )
