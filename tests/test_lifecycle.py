"""Lifecycle: saves in flight at interpreter exit are finished; dropping a busy checkpointer warns."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch
from conftest import run_python

import asyncckpt
from asyncckpt._codecs import PerTensorEncoder

_EXIT_WITHOUT_CLOSE = """
import sys, torch, asyncckpt
ckpt = asyncckpt.AsyncCheckpointer(sys.argv[1], zstd_level=19)
gen = torch.Generator().manual_seed(0)
ckpt.save(1, {"w": torch.randn(1 << 22, generator=gen)})
print("returning from main without close()", flush=True)
"""


def test_inflight_save_is_finished_at_interpreter_exit(run_dir: Path) -> None:
    proc = run_python(_EXIT_WITHOUT_CLOSE, str(run_dir))
    assert "without close()" in proc.stdout
    assert asyncckpt.latest_step(run_dir) == 1
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(asyncckpt.load(run_dir)["w"], torch.randn(1 << 22, generator=gen))


def test_dropping_a_busy_checkpointer_warns(run_dir: Path) -> None:
    ckpt = asyncckpt.AsyncCheckpointer(run_dir)
    gate = threading.Event()
    inner = ckpt._backend.encoder

    class Held(PerTensorEncoder):
        name = inner.name

        def encode(self, raw: torch.Tensor, dtype: torch.dtype, key: str):  # type: ignore[no-untyped-def]
            gate.wait(30)
            return inner.encode(raw, dtype, key)

    ckpt._backend.encoder = Held()
    ckpt.save(1, {"w": torch.ones(2)})
    with pytest.warns(ResourceWarning, match="dropped with 1 save"):
        ckpt.__del__()
    gate.set()
    ckpt.close()
    del ckpt
    gc.collect()
    assert asyncckpt.latest_step(run_dir) == 1


def test_closed_checkpointer_refuses_saves(run_dir: Path) -> None:
    ckpt = asyncckpt.AsyncCheckpointer(run_dir)
    ckpt.close()
    ckpt.close()  # idempotent
    with pytest.raises(asyncckpt.CheckpointError, match="closed"):
        ckpt.save(1, {})
