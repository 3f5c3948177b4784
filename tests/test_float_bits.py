"""Python floats in a state round-trip bit for bit: NaN sign and payload, signalling NaNs, -0.0, infinities."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt._manifest import MANIFEST_NAME
from asyncckpt._manifest_digest import DIGEST_FIELD, seal

BITS = [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF8000000000001, 0xFFFFFFFFFFFFFFFF, 0x7FF0000000000001,
        0xFFF4000000000abc, 0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000, 0x0000000000000001]  # fmt: skip


def _float(bits: int) -> float:
    value: float = struct.unpack("<d", struct.pack("<Q", bits))[0]
    return value


def _bits(value: float) -> int:
    bits: int = struct.unpack("<Q", struct.pack("<d", value))[0]
    return bits


@pytest.mark.parametrize("walk", ["fast", "full"])  # bytes are not in the fast path's common case
def test_float_scalars_keep_every_bit(run_dir: Path, walk: str) -> None:
    floats = [_float(b) for b in BITS]
    state = {"floats": floats, "nested": {"lr": floats[2]}, "w": torch.ones(2)}
    if walk == "full":
        state["blob"] = b"\x00"  # type: ignore[assignment]
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        ckpt.save(1, state).result()
    back = asyncckpt.load(run_dir)
    assert [_bits(x) for x in back["floats"]] == BITS
    assert _bits(back["nested"]["lr"]) == BITS[2]


def test_the_bare_nan_of_older_manifests_and_hostile_nan_bits(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        path = ckpt.save(1, {"x": 1.0, "w": torch.ones(1)}).result().path
    assert path is not None
    for text, expected in (
        ("nan", 0x7FF8000000000000),
        ("nan:0x0000000000000000", None),
        ("nan:0x7ff0000000000000", None),
    ):
        doc = json.loads((path / MANIFEST_NAME).read_bytes())
        del doc[DIGEST_FIELD]
        items = doc["structure"]["items"]
        next(item for item in items if item[0]["v"] == "x")[1]["v"] = text
        (path / MANIFEST_NAME).write_bytes(seal(doc))
        if expected is None:
            with pytest.raises(asyncckpt.CorruptCheckpointError, match="not of a NaN"):
                asyncckpt.load(run_dir)
        else:
            assert _bits(asyncckpt.load(run_dir)["x"]) == expected
