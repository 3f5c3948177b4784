"""Codecs: which encoder compresses a tensor, and which decoder reads a blob back.

Built in (host buffers): ``none`` and ``zstd`` (byte planes + Zstandard). The GPU codecs
(nvCOMP) register themselves here when :mod:`asyncckpt.gpu` is importable; a manifest that
names a codec this machine cannot decode fails with an error that says what to install.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CheckpointError, CorruptCheckpointError, gpu_extra_hint
from .base import CPU_CODECS, GPU_ONLY_CODECS, Decoder, EncodedBlob, Encoder, PerTensorEncoder
from .deflate import DeflateDecoder
from .lz4 import Lz4Decoder
from .none import NoneCodec
from .zstd import ZstdCodec

__all__ = ["Decoder", "EncodedBlob", "Encoder", "NoneCodec", "PerTensorEncoder", "ZstdCodec", "get_decoder",
           "register_decoder", "GPU_ONLY_CODECS", "CPU_CODECS", "MAX_EXPANSION", "check_expansion"]  # fmt: skip


MAX_EXPANSION: dict[str, tuple[int, int]] = {"none": (1, 0), "zstd": (1 << 15, 0), "lz4": (256, 64),
                                              "deflate": (1040, 1024)}  # fmt: skip
"""Per codec ``(a, b)``: a chunk of ``s`` stored bytes never decodes to more than ``a * s + b`` bytes.

The formats' own limits: a Zstandard block holds at most 128 KiB and takes at least 4 bytes (an
RLE block); an LZ4 sequence adds at most 255 bytes of match per byte; DEFLATE at most 258 bytes
per 2 bits (1032:1). A manifest that claims more is corrupt, and is refused before anything is
allocated, so what a reader allocates is bounded by the bytes the file really holds."""

_decoder_factories: dict[str, Callable[[], Decoder]] = {"none": NoneCodec, "zstd": ZstdCodec, "lz4": Lz4Decoder,
                                                         "deflate": DeflateDecoder}  # fmt: skip
_decoders: dict[str, Decoder] = {}


def register_decoder(name: str, factory: Callable[[], Decoder]) -> None:
    """Make ``name`` decodable (used by the GPU package for nvCOMP formats)."""
    _decoder_factories[name] = factory
    _decoders.pop(name, None)


def get_decoder(name: object, where: str) -> Decoder:
    """The decoder for a codec named in a manifest; ``where`` locates it in error messages."""
    if not isinstance(name, str):
        raise CorruptCheckpointError(f"{where}: codec name is not a string: {name!r}")
    if name not in _decoder_factories and name in GPU_ONLY_CODECS:
        from ..gpu.deps import gpu_path_available  # cheap: nothing optional is imported without CUDA

        if gpu_path_available():
            from ..gpu.decoders import nvcomp_decoder_factories

            for gpu_name, factory in nvcomp_decoder_factories().items():  # the GPU-only formats
                register_decoder(gpu_name, factory)
    if name not in _decoder_factories:
        if name in GPU_ONLY_CODECS:
            raise CheckpointError(
                f"{where}: codec {name!r} is an nvCOMP GPU format and needs a CUDA GPU with the GPU extra to "
                f"decode:\n{gpu_extra_hint()}\nOr convert the checkpoint on a GPU machine: "
                "asyncckpt convert CKPT OUT --codec zstd"
            )
        raise CorruptCheckpointError(f"{where}: unknown codec {name!r} (known: {sorted(_decoder_factories)})")
    if name not in _decoders:
        _decoders[name] = _decoder_factories[name]()
    return _decoders[name]


def check_expansion(codec: str, chunks: list[list[int]], where: str) -> None:
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
