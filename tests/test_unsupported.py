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


def _freed() -> torch.Tensor:
    """A tensor whose storage was resized to nothing, as FSDP frees parameters: copying it would crash."""
    t = torch.ones(4)
    t.untyped_storage().resize_(0)
    return t


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
        ({"freed": {"w": _freed()}}, "'freed/w' has 4 elements but no memory"),
        ({"freed": [torch.ones(2), _freed()]}, "'freed/1' has 4 elements but no memory"),
        ({"seed": 10**5000}, "int of 16610 bits at 'seed'"),
        ({"optim": {10**5000: torch.ones(1)}}, "at 'optim/<key>'"),
        ({"ids": [1, -(10**5000)]}, "at 'ids/1'"),
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
