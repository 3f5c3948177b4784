"""Empty tensors in any position, for every writer: a 0-byte blob at the end of a data file is valid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import asyncckpt
from asyncckpt._manifest import MANIFEST_NAME
from asyncckpt.distributed import DistributedCheckpointer, load_rank
from asyncckpt.integrations.dcp import AsyncCkptReader, AsyncCkptWriter
from asyncckpt.testing.state_compare import first_difference


def _states() -> list[dict[str, torch.Tensor]]:
    empty = torch.empty(0, 3)
    return [
        {"a": torch.randn(10), "empty": empty},  # the case: the last blob is empty
        {"empty": torch.empty(0, dtype=torch.int64), "a": torch.randn(10)},
        {
            "a": torch.randn(10),
            "e1": torch.empty(0, 3),
            "b": torch.arange(7),
            "e2": torch.empty(2, 0, dtype=torch.bfloat16),
        },
        {"only": torch.empty(0)},
        {"e1": torch.empty(0), "e2": torch.empty(0, dtype=torch.float64), "e3": torch.empty(5, 0)[:, ::2]},
    ]


@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("case", range(5))
def test_single_process(run_dir: Path, codec: str, case: int) -> None:
    state = _states()[case]
    with asyncckpt.AsyncCheckpointer(run_dir, codec=codec) as ckpt:
        path = ckpt.save(1, state).result().path
    assert path is not None
    records = json.loads((path / MANIFEST_NAME).read_bytes())["tensors"]
    size = (path / "data-0.bin").stat().st_size
    assert any(r["stored_bytes"] == 0 or r["raw_bytes"] == 0 for r in records)
    assert all(r["offset"] + r["stored_bytes"] <= size or r["stored_bytes"] == 0 for r in records)
    assert first_difference(state, asyncckpt.load(run_dir)) is None
    assert asyncckpt.verify(run_dir).tensors == len(records)


def test_an_empty_blob_beyond_the_aligned_end_is_still_refused(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir, codec="none") as ckpt:
        path = ckpt.save(1, _states()[0]).result().path
    assert path is not None
    from asyncckpt._manifest_digest import DIGEST_FIELD, seal

    doc = json.loads((path / MANIFEST_NAME).read_bytes())
    del doc[DIGEST_FIELD]
    doc["tensors"][1]["offset"] = 8192  # the file is 40 bytes: its aligned end is 4096
    (path / MANIFEST_NAME).write_bytes(seal(doc))
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="'empty'.*offset 8192 of 0 bytes extends past the end"):
        asyncckpt.verify(run_dir)


def test_distributed_ranks_with_empty_tensors_last(tmp_path: Path) -> None:
    root = tmp_path / "run"
    ranks = [DistributedCheckpointer(root, rank=r, world_size=2, session="s1") for r in (0, 1)]
    states = [{"x": torch.full((4,), float(r)), "empty": torch.empty(0, 3)} for r in (0, 1)]
    for handle in [ckpt.save(3, state) for ckpt, state in zip(ranks, states, strict=True)]:
        handle.result(timeout=30)
    for ckpt in ranks:
        ckpt.close()
    assert first_difference({0: states[0], 1: states[1]}, asyncckpt.load(root)) is None
    assert first_difference(states[1], load_rank(root, 1)) is None
    asyncckpt.verify(root)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_dcp_plugin(tmp_path: Path, codec: str) -> None:
    state = {"a": torch.randn(10), "empty": torch.empty(0, 3)}
    dcp.save(state, storage_writer=AsyncCkptWriter(tmp_path / "c", codec=codec), no_dist=True)
    back = {"a": torch.zeros(10), "empty": torch.zeros(0, 3)}
    dcp.load(back, storage_reader=AsyncCkptReader(tmp_path / "c"), no_dist=True)
    assert first_difference(state, back) is None
    asyncckpt.verify(tmp_path / "c")
