"""max_inflight bounds the saves in flight; the wait for a slot is reported as stall, or the save is skipped."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

import asyncckpt
from asyncckpt._codecs import EncodedBlob, Encoder, PerTensorEncoder


class GatedEncoder(PerTensorEncoder):
    """Wraps the real encoder and holds the worker until the test opens the gate."""

    def __init__(self, inner: Encoder) -> None:
        self.inner, self.name = inner, inner.name
        self.gate = threading.Event()

    def encode(self, raw: torch.Tensor, dtype: torch.dtype, key: str) -> EncodedBlob:
        self.gate.wait(30)
        return self.inner.encode(raw, dtype, key)


def _gated(ckpt: asyncckpt.AsyncCheckpointer) -> GatedEncoder:
    gated = GatedEncoder(ckpt._backend.encoder)
    ckpt._backend.encoder = gated
    return gated


def test_next_save_waits_for_a_slot_and_counts_it_as_stall(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir, max_inflight=1) as ckpt:
        gated = _gated(ckpt)
        first = ckpt.save(1, {"w": torch.ones(4)})
        assert first.staged and not first.done()
        threading.Timer(0.3, gated.gate.set).start()
        second = ckpt.save(2, {"w": torch.ones(4)})
        assert first.done(), "save() returned only after a slot was free"
        assert second.stall_seconds >= 0.2
        assert second.result().stall_seconds == second.stall_seconds
    assert asyncckpt.latest_step(run_dir) == 2


def test_two_slots_let_two_saves_queue_without_waiting(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir, max_inflight=2) as ckpt:
        gated = _gated(ckpt)
        first, second = ckpt.save(1, {"w": torch.ones(4)}), ckpt.save(2, {"w": torch.ones(4)})
        assert ckpt.inflight == 2 and not first.done() and not second.done()
        gated.gate.set()
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [1, 2]


def test_skip_policy_skips_while_busy(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir, when_busy="skip") as ckpt:
        gated = _gated(ckpt)
        ckpt.save(1, {"w": torch.ones(4)})
        skipped = ckpt.save(2, {"w": torch.ones(4)})
        assert skipped.done() and skipped.result().skipped and skipped.result().path is None
        gated.gate.set()
        ckpt.wait()
        ckpt.save(3, {"w": torch.ones(4)}).result()
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [1, 3]


def test_wait_timeout_and_handle_timeout(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        gated = _gated(ckpt)
        handle = ckpt.save(1, {"w": torch.ones(4)})
        assert handle.wait(0.05) is False
        try:
            ckpt.wait(timeout=0.05)
            raise AssertionError("wait() should have timed out")
        except asyncckpt.CheckpointError as exc:
            assert "not finished" in str(exc)
        gated.gate.set()
        assert handle.wait(30) is True


def test_targeted_skip_leaves_no_pending_path(tmp_path: Path) -> None:
    """A save_to() skipped while busy is not waited for and never commits to its path later."""
    from asyncckpt.integrations._targeted import TargetedCheckpointer

    with TargetedCheckpointer(tmp_path / "run", when_busy="skip", max_inflight=1) as ckpt:
        gated = _gated(ckpt)
        first = ckpt.save_to(tmp_path / "a.ckpt", {"w": torch.ones(4)})
        skipped = ckpt.save_to(tmp_path / "b.ckpt", {"w": torch.zeros(4)})
        assert skipped.done() and skipped.result().skipped
        assert ckpt._targets.numbers_for((tmp_path / "b.ckpt").absolute()) == []
        gated.gate.set()
        ckpt.wait_for(tmp_path / "a.ckpt")
        assert first.result().path is not None
    assert (tmp_path / "a.ckpt").is_dir() and not (tmp_path / "b.ckpt").exists()
