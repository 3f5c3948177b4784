"""Property: any state the README allows saves, loads bit for bit (ties kept) and verifies, for every CPU codec.

``none`` and ``zstd`` are written by the checkpointer; ``lz4`` and ``deflate`` (written by the GPU
path) are the same checkpoint re-encoded by :func:`property_states.transcode`, read by the CPU
decoders. Example counts: ``HYPOTHESIS_PROFILE=ci`` (default) or ``nightly``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_states import difference, states, tied_difference, transcode

import asyncckpt
from asyncckpt._codecs import ZstdCodec


def _check(checkpoint: Path, state: Any, codec: str) -> None:
    back = asyncckpt.load(checkpoint)
    found = difference(state, back) or tied_difference(state, back)
    assert found is None, f"{codec}: {found}"
    assert asyncckpt.verify(checkpoint).manifest_digest is not None


# complex32 tensors: torch warns once per process that ComplexHalf is experimental.
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@given(state=states())
def test_any_state_round_trips_bit_for_bit_with_every_cpu_codec(state: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="asyncckpt-property-") as tmp:
        root = Path(tmp)
        for codec in ("none", "zstd"):
            with asyncckpt.AsyncCheckpointer(root / codec, codec=codec) as ckpt:
                path = ckpt.save(1, state).result().path
            assert path is not None
            _check(path, state, codec)
        for codec in ("lz4", "deflate"):
            transcode(root / "none" / "step-0000000001", root / codec, codec)
            _check(root / codec, state, codec)


@given(data=st.binary(max_size=20_000), planes=st.sampled_from([1, 2, 4, 8, 16]), chunk_kib=st.integers(4, 6))
def test_the_zstd_codec_round_trips_any_bytes_in_any_chunking(data: bytes, planes: int, chunk_kib: int) -> None:
    raw = torch.frombuffer(bytearray(data[: len(data) // planes * planes]) or bytearray(1), dtype=torch.uint8)
    raw = raw[: len(data) // planes * planes]
    dtype = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.float64, 16: torch.complex128}[planes]
    codec = ZstdCodec(chunk_bytes=chunk_kib << 10, threads=2)
    try:
        blob = codec.encode(raw, dtype, "k")
        out = torch.empty(raw.numel(), dtype=torch.uint8)
        codec.decode(blob.data, list(blob.chunks), blob.params, out)
    finally:
        codec.close()
    assert bytes(out.numpy()) == bytes(raw.numpy())
