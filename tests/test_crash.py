"""A process killed (SIGKILL) in the middle of a write leaves the latest good checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import REPO

import asyncckpt

_WRITER = """
import sys, torch, asyncckpt
run = sys.argv[1]
ckpt = asyncckpt.AsyncCheckpointer(run, codec="zstd", zstd_level=19)
ckpt.save(1, {"w": torch.full((1000,), 1.0)}).result()
print("committed", flush=True)
# A large, slow save (zstd level 19 on 64 MiB) that the parent kills while it is being written.
gen = torch.Generator().manual_seed(0)
ckpt.save(2, {"w": torch.randn(16 << 20, generator=gen)})
print("saving", flush=True)
ckpt.wait()
print("finished", flush=True)
"""


def test_sigkill_mid_write_keeps_the_latest_good_checkpoint(run_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(run_dir)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "committed"
        assert proc.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 60
        data_file = None
        while data_file is None and time.monotonic() < deadline:  # wait until the data file is being written
            temporaries = [p for p in run_dir.iterdir() if p.name.startswith(".tmp-")]
            files = [f for t in temporaries for f in t.glob("data-*.bin") if f.stat().st_size > 0]
            data_file = files[0] if files else None
            time.sleep(0.01)
        assert data_file is not None, "the second save never started writing"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert asyncckpt.latest_step(run_dir) == 1
    assert torch.equal(asyncckpt.load(run_dir)["w"], torch.full((1000,), 1.0))
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [1]
    leftovers = [p for p in run_dir.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the killed save left its temporary directory (ignored by readers)"
    # The next checkpointer on this host removes what the dead process left behind.
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        assert not [p for p in run_dir.iterdir() if p.name.startswith(".tmp-")]
        ckpt.save(3, {"w": torch.zeros(2)}).result()
    assert asyncckpt.latest_step(run_dir) == 3
