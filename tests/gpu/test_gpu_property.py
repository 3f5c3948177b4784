"""Property, on the GPU: random CUDA states save and restore bit for bit in every snapshot mode and GPU codec.

The states of ``tests/property_states.py`` (every dtype; empty, 0-d, strided, non-contiguous, tied
tensors; every scalar type) on the current CUDA device. One checkpointer per (snapshot, codec)
lives for the whole module, so an example costs a save and a few loads, not a pipeline start.
Restored on the GPU (nvCOMP decode, CRC-32 on the device) and, for the formats a CPU can decode,
with ``map_location="cpu"`` too; then verified. ``HYPOTHESIS_PROFILE=nightly`` runs more examples.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_env import requires_gpu
from hypothesis import given, settings
from property_states import difference, leaves_of, states, tied_difference

import asyncckpt
from asyncckpt._codecs import CPU_CODECS
from asyncckpt._manifest import read_manifest

pytestmark = [*requires_gpu, pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")]

MODES = [("device", "auto"), ("fence", "auto"), ("host", "auto"), ("device", "ans"), ("fence", "bitcomp"),
         ("device", "cascaded"), ("device", "gdeflate"), ("fence", "lz4"), ("host", "deflate"), ("device", "zstd"),
         ("device", "none")]  # fmt: skip
"""Every snapshot mode and every codec once (``fence`` needs a codec: it is refused with ``none``)."""

_EXAMPLES = 8 if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else 300
_steps = itertools.count(1)


@pytest.fixture(scope="module")
def checkpointers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Any]]:
    root = tmp_path_factory.mktemp("gpu-property")
    made: dict[tuple[str, str], Any] = {}
    try:
        for snapshot, codec in MODES:
            made[(snapshot, codec)] = asyncckpt.AsyncCheckpointer(
                root / f"{snapshot}-{codec}", snapshot=snapshot, codec=codec, keep_last=1
            )
        yield made
    finally:
        for ckpt in made.values():
            ckpt.close()


def _same_devices(expected: Any, actual: Any) -> str | None:
    for i, (a, b) in enumerate(zip(leaves_of(expected), leaves_of(actual), strict=True)):
        if isinstance(a, torch.Tensor) and a.device != b.device:
            return f"leaf {i}: saved from {a.device}, restored to {b.device}"
    return None


@settings(max_examples=_EXAMPLES)
@given(state=states(device="cuda", max_leaves=10))
def test_any_cuda_state_round_trips_in_every_mode_and_codec(
    checkpointers: dict[tuple[str, str], Any], state: dict[str, Any]
) -> None:
    step = next(_steps)
    for (snapshot, codec), ckpt in checkpointers.items():
        where = f"snapshot={snapshot} codec={codec}"
        path: Path | None = ckpt.save(step, state).result(60).path
        assert path is not None
        back = asyncckpt.load(path)
        found = difference(state, back) or tied_difference(state, back) or _same_devices(state, back)
        assert found is None, f"{where}: {found}"
        if all(record.codec in CPU_CODECS for record in read_manifest(path).tensors):
            on_cpu = asyncckpt.load(path, map_location="cpu")
            assert difference(state, on_cpu) is None, f"{where}, map_location=cpu"
        assert asyncckpt.verify(path).manifest_digest is not None
