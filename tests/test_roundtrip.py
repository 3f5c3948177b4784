"""Round trip: what save() stores, load() returns bit for bit, with its original structure and types."""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from conftest import small_training_state

import asyncckpt
from asyncckpt._dtypes import DTYPE_BY_NAME
from asyncckpt.testing.state_compare import first_difference


def _every_dtype_tensor(dtype: torch.dtype) -> torch.Tensor:
    # Random bytes reinterpreted as the dtype: covers NaN payloads, denormals and every bit pattern.
    gen = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (6 * 5 * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw[:30] % 2).to(torch.bool).view(6, 5)
    return raw.view(dtype).view(6, 5)


def _roundtrip(run_dir: Path, state: object, **options: object) -> object:
    with asyncckpt.AsyncCheckpointer(run_dir, **options) as ckpt:
        ckpt.save(1, state).result()
    return asyncckpt.load(run_dir)


@pytest.mark.parametrize("codec", ["zstd", "none"])
def test_every_dtype_roundtrips_bit_for_bit(run_dir: Path, codec: str) -> None:
    state = {name: _every_dtype_tensor(dtype) for name, dtype in DTYPE_BY_NAME.items()}
    restored = _roundtrip(run_dir, state, codec=codec)
    assert first_difference(state, restored) is None
    assert set(DTYPE_BY_NAME) >= {"bfloat16", "float8_e4m3fn", "complex64", "bool", "uint64"}


def test_every_small_dtype_roundtrips_under_deterministic_algorithms(run_dir: Path) -> None:
    # Lightning's deterministic=True turns this on for the whole process; fresh tensors are then
    # filled on allocation, which torch cannot do for every dtype (float4).
    state = {name: _every_dtype_tensor(dtype)[:1] for name, dtype in DTYPE_BY_NAME.items()}  # small: host clones
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        restored = _roundtrip(run_dir, state, codec="none")
    finally:
        torch.use_deterministic_algorithms(previous)
    assert first_difference(state, restored) is None


def test_shapes_views_and_shared_storage(run_dir: Path) -> None:
    base = torch.arange(60, dtype=torch.float32).view(6, 10)
    state = {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),  # non-contiguous
        "strided": base[::2, 1::3],  # strided view into the same storage as `base`
        "base": base,
        "alias": base,  # the same tensor twice, as tied weights appear in a state_dict
        "expanded": torch.ones(3, 1).expand(3, 4),  # stride 0
    }
    restored = _roundtrip(run_dir, state)
    assert first_difference(state, restored) is None
    assert restored["alias"] is restored["base"], "aliased tensors come back as one tensor"
    assert restored["transposed"].is_contiguous()


@pytest.mark.parametrize("n", [3, 3000])  # a host clone and an arena copy (asyncckpt._snapshot.host.CLONE_BYTES)
def test_conjugate_and_negative_views_keep_their_values_beside_their_base(run_dir: Path, n: int) -> None:
    z = torch.randn(n, dtype=torch.complex64, generator=torch.Generator().manual_seed(n))
    # All four share z's memory: the lazy conjugate and negative bits make them different values.
    state = {"z": z, "conj": z.conj(), "imag": z.imag, "neg_imag": z.conj().imag}
    assert state["conj"].is_conj() and state["neg_imag"].is_neg()
    restored = _roundtrip(run_dir, state, codec="zstd")
    assert first_difference(state, restored) is None
    assert torch.equal(restored["conj"], z.conj()) and torch.equal(restored["neg_imag"], -z.imag)
    assert restored["conj"] is not restored["z"]


def test_scalar_subclasses_load_as_their_base_type(run_dir: Path) -> None:
    import enum

    class Stage(enum.IntEnum):
        FIT = 3

    restored = _roundtrip(run_dir, {"stage": Stage.FIT, "blob": bytearray(b"\x00\xff"), "w": torch.ones(1)})
    assert type(restored["stage"]) is int and restored["stage"] == 3  # never a user class on load
    assert type(restored["blob"]) is bytes and restored["blob"] == b"\x00\xff"


def test_structure_and_plain_values(run_dir: Path) -> None:
    state = {
        "odict": OrderedDict([("b", 1), ("a", 2)]),
        "int_keys": {0: torch.ones(2), 7: {"exp_avg": torch.zeros(2)}},
        "tuple": (1, 2.5, "x"),
        "list": [None, True, False, b"\x00\xff"],
        "floats": [float("nan"), float("inf"), -float("inf"), -0.0, 1e-310],
        "big_int": 2**70,
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "unicode": "Größe ✓",
    }
    restored = _roundtrip(run_dir, state)
    assert first_difference(state, restored) is None
    assert type(restored["odict"]) is OrderedDict and list(restored["odict"]) == ["b", "a"]
    assert list(restored["int_keys"]) == [0, 7] and all(type(k) is int for k in restored["int_keys"])
    assert type(restored["tuple"]) is tuple and type(restored["size"]) is torch.Size
    assert math.copysign(1, restored["floats"][3]) == -1.0 and restored["floats"][4] == 1e-310


def test_model_and_optimizer_load_back_into_fresh_objects(run_dir: Path) -> None:
    _model, optimizer, state = small_training_state()
    state = {**state, "step": 3}
    restored = _roundtrip(run_dir, state)
    assert first_difference(state, restored) is None
    from asyncckpt.testing.demo_model import TinyGPT

    fresh = TinyGPT(width=32, layers=2, heads=2, context=32)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh.load_state_dict(restored["model"])
    fresh_opt.load_state_dict(restored["optim"])
    assert first_difference(optimizer.state_dict(), fresh_opt.state_dict()) is None
    assert list(restored["optim"]["state"]) == list(range(len(restored["optim"]["state"])))


def test_steps_metadata_and_map_location(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        for step in (100, 200, 300):
            ckpt.save(step, {"w": torch.full((4,), float(step))}, metadata={"loss": step / 100})
    assert asyncckpt.latest_step(run_dir) == 300
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [100, 200, 300]
    assert asyncckpt.load(run_dir, step=200, map_location="cpu")["w"][0] == 200
    checkpoint = asyncckpt.list_checkpoints(run_dir)[0].path
    assert asyncckpt.load(checkpoint)["w"][0] == 100  # a checkpoint directory itself
    assert asyncckpt.verify(run_dir).step == 300
    from asyncckpt._manifest import read_manifest

    assert read_manifest(checkpoint).metadata == {"loss": 1.0}
    with pytest.raises(asyncckpt.CheckpointError, match="no committed checkpoint for step 5"):
        asyncckpt.load(run_dir, step=5)


def test_result_reports_sizes_and_stages(run_dir: Path) -> None:
    state = {"zeros": torch.zeros(1 << 16), "ints": torch.arange(1000)}
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        handle = ckpt.save(7, state)
        assert handle.staged
        result = handle.result()
    assert handle.done()
    assert result.step == 7 and result.path == run_dir / "step-0000000007"
    assert result.raw_bytes == (1 << 16) * 4 + 1000 * 8
    assert result.stored_bytes < result.raw_bytes / 10  # zeros compress
    assert set(result.stage_seconds) == {"snapshot", "compress", "write", "fsync", "commit"}
    assert result.durable_seconds >= result.stall_seconds > 0
