"""Whatever save() accepts, load() and list_checkpoints() read back; the rest save() refuses up front."""

from __future__ import annotations

import warnings
from enum import Enum, IntEnum
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt._tree import MAX_DEPTH


class Color(str, Enum):  # the shape of Hugging Face's ExplicitEnum
    RED = "red"


class Level(IntEnum):
    HIGH = 3


def _in_lists(leaf: object, levels: int) -> object:
    for _ in range(levels):
        leaf = [leaf]
    return leaf


def test_a_tensor_as_deep_as_load_reads_round_trips_and_one_level_deeper_is_refused(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        ckpt.save(1, {"deep": _in_lists(torch.arange(3), MAX_DEPTH - 1)}).result()
        with pytest.raises(TypeError, match=r"nested deeper than 64 levels at 'deep/0/0/.*/0'"):
            ckpt.save(2, {"deep": _in_lists(torch.arange(3), MAX_DEPTH)})
    loaded = asyncckpt.load(run_dir)["deep"]
    for _ in range(MAX_DEPTH - 1):
        loaded = loaded[0]
    assert torch.equal(loaded, torch.arange(3))
    asyncckpt.verify(run_dir)
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [1]


def test_steps_beyond_what_load_reads_are_refused_and_the_largest_round_trips(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        for bad in (2**62 + 1, 10**20):
            with pytest.raises(asyncckpt.CheckpointError, match=r"at most 2\*\*62"):
                ckpt.save(bad, {"w": torch.ones(1)})
        ckpt.save(2**62, {"w": torch.ones(1)}).result()
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [2**62]
    assert asyncckpt.latest_step(run_dir) == 2**62
    assert asyncckpt.load(run_dir, step=2**62)["w"].item() == 1.0
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".")]


def test_text_a_manifest_could_not_hold_is_refused_by_save(run_dir: Path) -> None:
    blob = bytes(200 << 20)  # 200 MiB: 267 MiB of base64, past the 256 MiB load() reads
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        with pytest.raises(TypeError, match=r"more than 256 MiB in the manifest \(passed at 'extra/blob'\).*uint8"):
            ckpt.save(1, {"extra": {"blob": blob}, "w": torch.ones(1)})
        # A long str goes the full walk too, and text is counted across the whole state.
        with pytest.raises(TypeError, match=r"passed at 'b'"):
            ckpt.save(2, {"a": "x" * (130 << 20), "b": "y" * (130 << 20)})
        with pytest.raises(TypeError, match="metadata takes .* bytes as JSON"):
            ckpt.save(3, {"w": torch.ones(1)}, metadata={"notes": "n" * (257 << 20)})
        ckpt.save(3, {"blob": bytes(1 << 20), "s": "z" * 5000}).result()
    assert asyncckpt.list_checkpoints(run_dir)[0].step == 3
    state = asyncckpt.load(run_dir)
    assert state["blob"] == bytes(1 << 20) and state["s"] == "z" * 5000


def test_a_nested_tensor_is_refused_by_save_naming_its_key(run_dir: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        for state in ({"batch": {"nt": nested}}, {"batch": {"nt": [nested]}}):
            with pytest.raises(TypeError, match="nested tensor at 'batch/nt.*unbind"):
                ckpt.save(1, state)
        ckpt.save(1, {"ok": torch.ones(1)}).result()


def test_enum_values_and_keys_are_stored_and_loaded_as_their_base_values(run_dir: Path) -> None:
    state = {"color": Color.RED, "level": Level.HIGH, "by_color": {Color.RED: torch.ones(2)}, Level.HIGH: [Color.RED]}
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        ckpt.save(1, state).result()
    loaded = asyncckpt.load(run_dir)
    assert loaded == {"color": "red", "level": 3, "by_color": {"red": loaded["by_color"]["red"]}, 3: ["red"]}
    assert type(loaded["color"]) is str and type(loaded["level"]) is int
    assert [type(k) for k in loaded] == [str, str, str, int]
    manifest = (run_dir / "step-0000000001" / "manifest.json").read_text()
    assert "Color.RED" not in manifest and "by_color/red" in manifest  # the tensor's key path uses the value
