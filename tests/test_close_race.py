"""save() from several threads, close() during save(), and observer hooks that raise."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import REFUSED_WRITES_PRELUDE, run_python

import asyncckpt
from asyncckpt.observer import NullObserver
from asyncckpt.result import SaveResult


class _HoldFirstStaged(NullObserver):
    """Holds the first save() inside its save_staged hook (training side, past the step checks) until released."""

    def __init__(self) -> None:
        self.inside = threading.Event()
        self.release = threading.Event()

    def save_staged(self, stall_seconds: float, staging_bytes: int, inflight: int) -> None:
        if not self.inside.is_set():
            self.inside.set()
            assert self.release.wait(30)


def _in_thread(fn: object) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_second_save_of_a_step_being_saved_is_refused_at_once(run_dir: Path) -> None:
    hold = _HoldFirstStaged()
    ckpt = asyncckpt.AsyncCheckpointer(run_dir, observer=hold)
    first, out = _in_thread(lambda: ckpt.save(7, {"w": torch.ones(4)}))
    assert hold.inside.wait(30)
    began = time.monotonic()
    with pytest.raises(asyncckpt.CheckpointError, match=r"step 7 is being saved in .* \(by this or another thread\)"):
        ckpt.save(7, {"w": torch.zeros(4)})
    assert time.monotonic() - began < 5
    hold.release.set()
    first.join(30)
    assert isinstance(out.get("value"), asyncckpt.SaveHandle), out
    ckpt.close()
    assert torch.equal(asyncckpt.load(run_dir, step=7)["w"], torch.ones(4))


def test_threads_racing_on_one_step_exactly_one_is_accepted(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir, max_inflight=8) as ckpt:
        for step in range(5):
            barrier = threading.Barrier(6)

            def save(step: int = step, barrier: threading.Barrier = barrier) -> SaveResult:
                barrier.wait()
                return ckpt.save(step, {"w": torch.full((1000,), float(step))}).result(30)

            runs = [_in_thread(save) for _ in range(6)]
            for thread, _ in runs:
                thread.join(60)
            results = [out for _, out in runs]
            assert sum("value" in r for r in results) == 1, results
            for r in results:
                if "error" in r:
                    assert isinstance(r["error"], asyncckpt.CheckpointError)
                    assert not isinstance(r["error"], asyncckpt.SaveFailedError), r["error"]  # refused, not failed
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == list(range(5))


def test_close_during_save_lets_that_save_complete_and_refuses_later_ones(run_dir: Path) -> None:
    hold = _HoldFirstStaged()
    ckpt = asyncckpt.AsyncCheckpointer(run_dir, observer=hold)
    saver, saved = _in_thread(lambda: ckpt.save(7, {"w": torch.ones(4)}))
    assert hold.inside.wait(30)
    closer, closed = _in_thread(ckpt.close)
    deadline = time.monotonic() + 30
    while not ckpt._closed and time.monotonic() < deadline:  # close() has begun and waits for the save
        time.sleep(0.005)
    with pytest.raises(asyncckpt.CheckpointError, match="closed"):
        ckpt.save(8, {"w": torch.ones(4)})
    assert closer.is_alive(), "close() returned while a save() was still inside"
    hold.release.set()
    saver.join(30)
    closer.join(30)
    assert not closer.is_alive() and closed == {"value": None}
    handle = saved["value"]
    assert isinstance(handle, asyncckpt.SaveHandle)
    assert handle.result(30).step == 7  # completes: before the fix its job was queued behind the worker's stop
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [7]


class _Raising(NullObserver):
    def __init__(self, *hooks: str) -> None:
        self.hooks = hooks

    def _maybe(self, hook: str) -> None:
        if hook in self.hooks:
            raise RuntimeError(f"{hook} is broken")

    def save_staged(self, stall_seconds: float, staging_bytes: int, inflight: int) -> None:
        self._maybe("save_staged")

    def save_finished(self, result: SaveResult, inflight: int) -> None:
        self._maybe("save_finished")

    def save_failed(self, error: BaseException, inflight: int) -> None:
        self._maybe("save_failed")


def test_an_observer_hook_that_raises_is_logged_and_counted_and_saves_go_on(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    observer = _Raising("save_staged", "save_finished", "save_failed")
    with caplog.at_level(logging.ERROR, logger="asyncckpt"):
        ckpt = asyncckpt.AsyncCheckpointer(run_dir, observer=observer)
        assert ckpt.save(1, {"w": torch.ones(2)}).result(30).step == 1
        assert ckpt.save(2, {"w": torch.ones(2)}).result(30).step == 2  # the worker is still alive
        assert ckpt.observer_errors == 4
        ckpt.close()
    assert sum("observer hook _Raising.save_finished raised" in r.getMessage() for r in caplog.records) == 2
    assert sum("save_staged raised" in r.getMessage() for r in caplog.records) == 2
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [1, 2]


_FAILING_SAVE = """
import torch
from asyncckpt.observer import NullObserver


class Raising(NullObserver):
    def save_failed(self, error, inflight):
        raise RuntimeError("save_failed is broken")


ckpt = asyncckpt.AsyncCheckpointer(sys.argv[1], observer=Raising(), codec="none")
handle = ckpt.save(1, {"w": torch.ones(1 << 20)})  # 4 MiB: the write fails with EFBIG
try:
    handle.result(60)
except asyncckpt.SaveFailedError as exc:
    print("failed:", "EFBIG" in repr(exc.__cause__) or "too large" in str(exc))
try:
    ckpt.save(2, {"w": torch.ones(4)})
except asyncckpt.SaveFailedError:
    print("reported once")
print("next:", ckpt.save(3, {"w": torch.ones(4)}).result(60).step, "errors:", ckpt.observer_errors)
ckpt.close()
"""


def test_a_raising_save_failed_hook_still_completes_the_failed_handle(run_dir: Path) -> None:
    proc = run_python(REFUSED_WRITES_PRELUDE + "import sys\n" + _FAILING_SAVE, str(run_dir), timeout=120)
    assert proc.stdout.split("\n")[:3] == ["failed: True", "reported once", "next: 3 errors: 1"], proc.stdout
    assert "observer hook Raising.save_failed raised" in proc.stderr
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [3]
