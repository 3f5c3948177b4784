"""Objects asyncckpt cannot store are refused by save() itself, naming the key path."""

from __future__ import annotations

from collections import namedtuple
from pathlib import Path

import pytest
import torch

import asyncckpt


class Opaque:
    pass


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize(
    ("state", "fragment"),
    [
        ({"model": {"layer": Opaque()}}, "model/layer"),
        ({"optim": {"state": {0: {"fn": lambda x: x}}}}, "optim/state/0/fn"),
        ({"sparse": torch.eye(3).to_sparse()}, "sparse"),
        ({"int4_kind": torch.empty(2, dtype=torch.uint8).view(torch.bits8)}, "int4_kind"),
        ({"meta": torch.empty(2, device="meta")}, "meta"),
        ({"nt": Point(1, 2)}, "nt"),
        ({"set": {1, 2}}, "set"),
        ({(1, 2): 3}, "unsupported dict key"),
    ],
)
def test_save_raises_type_error_naming_the_key(run_dir: Path, state: object, fragment: str) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        with pytest.raises(TypeError, match=fragment.replace("/", "/")):
            ckpt.save(1, state)
        assert asyncckpt.list_checkpoints(run_dir) == []
        ckpt.save(2, {"ok": torch.ones(1)}).result()  # the checkpointer is still usable


def test_metadata_must_be_json(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        with pytest.raises(TypeError, match="JSON"):
            ckpt.save(1, {}, metadata={"t": torch.ones(1)})
        with pytest.raises(TypeError, match="nan"):
            ckpt.save(1, {}, metadata={"x": float("nan")})


def test_invalid_steps_and_duplicate_steps(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        for bad in (-1, 1.5, "3", True):
            with pytest.raises(asyncckpt.CheckpointError, match="non-negative int"):
                ckpt.save(bad, {})  # type: ignore[arg-type]
        ckpt.save(5, {"a": torch.ones(1)}).result()
        with pytest.raises(asyncckpt.CheckpointError, match="step 5 is already saved"):
            ckpt.save(5, {"a": torch.zeros(1)})
    assert asyncckpt.load(run_dir)["a"][0] == 1
