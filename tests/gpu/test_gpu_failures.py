"""A write that fails on the GPU path (the disk refuses bytes) fails the save loudly, keeps the
previous checkpoint, leaves no temporary directory, and never leaves a training step waiting.

The refusal is real: the child process runs under a 1 MiB ``RLIMIT_FSIZE``, so the pinned
writer's ``pwrite`` (or KvikIO's, with ``ASYNCCKPT_COMPAT_IO=kvikio``) fails with EFBIG past the
first MiB of a file, as a full disk fails with ENOSPC; no root or small file system needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REFUSED_WRITES_PRELUDE, run_python
from gpu_env import requires_gpu, subprocess_env

pytestmark = requires_gpu

_REFUSED_WRITE = (
    REFUSED_WRITES_PRELUDE
    + """
import json, sys, torch
from asyncckpt.testing.state_compare import first_difference
run, snapshot = sys.argv[1], sys.argv[2]
small = {"w": torch.arange(1000, dtype=torch.float32, device="cuda")}
ckpt = asyncckpt.AsyncCheckpointer(run, snapshot=snapshot, codec="auto")
ckpt.save(1, small).result(60)
gen = torch.Generator(device="cuda").manual_seed(5)
# Random 32-bit integers viewed as floats: 8 MiB that no codec brings under the 1 MiB limit.
bits = torch.randint(-2**31, 2**31 - 1, (2 << 20,), dtype=torch.int32, device="cuda", generator=gen)
param = torch.nn.Parameter(bits.view(torch.float32).nan_to_num())
param.grad = torch.ones_like(param)
optimizer = torch.optim.SGD([param], lr=0.5)
handle = ckpt.save(2, {"w": param})
optimizer.step()  # fence mode: this step waits on the GPU for the compressor, then goes on
torch.cuda.synchronize()
out = {"stepped": bool((param.detach() != bits.view(torch.float32).nan_to_num()).any())}
out.update(failures(handle, ckpt))
out["latest"] = asyncckpt.latest_step(run)
out["kept_intact"] = first_difference(small, asyncckpt.load(run)) is None
print(json.dumps(out))
"""
)


@pytest.mark.parametrize(("snapshot", "compat_io"), [("device", ""), ("fence", ""), ("device", "kvikio")])
def test_a_refused_write_fails_the_save_and_keeps_the_last_checkpoint(
    tmp_path: Path, snapshot: str, compat_io: str
) -> None:
    run = tmp_path / "run"
    env = subprocess_env(ASYNCCKPT_COMPAT_IO=compat_io)
    proc = run_python(_REFUSED_WRITE, str(run), snapshot, env=env, timeout=180)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["stepped"], "the optimizer step after save() did not run"
    assert out["result"] is not None and "saving step 2" in out["result"], out
    assert out["close"] is not None and "saving step 2" in out["close"], out  # never reported by save()
    if not compat_io:  # the pinned writer raises the OSError itself; KvikIO words its own error
        assert "File too large" in out["result"] and "File too large" in out["close"], out
    assert out["latest"] == 1 and out["kept_intact"], out
    assert not [p.name for p in run.iterdir() if p.name.startswith(".tmp-")], "the failed save left a temporary dir"


_WRITER_AFTER_A_FAILURE = (
    REFUSED_WRITES_PRELUDE
    + """
import json, pathlib, sys, torch
from asyncckpt._gpu import pinned_io, storage
path, kind = pathlib.Path(sys.argv[1]), sys.argv[2]
device = torch.device("cuda", 0)
if kind == "pinned":
    writer = pinned_io.PinnedPosixWriter(path, device, inflight_bytes=64 << 20)
else:
    writer = storage.KvikioBlobWriter(path, inflight_bytes=64 << 20)
big = torch.ones(2 << 20, dtype=torch.uint8, device=device)  # 2 MiB > the 1 MiB limit
small = torch.ones(4, dtype=torch.uint8, device=device)
torch.cuda.synchronize()
out = {}
for name, call in (("big", lambda: writer.append(big)), ("sync", writer.sync),
                   ("small", lambda: writer.append(small)), ("sync again", writer.sync)):
    try:
        call()
        out[name] = None
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
writer.close()
print(json.dumps(out))
"""
)


@pytest.mark.parametrize("kind", ["pinned", "kvikio"])
def test_a_device_writer_that_failed_refuses_every_later_append_and_sync(tmp_path: Path, kind: str) -> None:
    proc = run_python(_WRITER_AFTER_A_FAILURE, str(tmp_path / "data.bin"), kind, env=subprocess_env(), timeout=120)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["big"] is None, out  # queued: the failure surfaces when it is waited for
    assert out["sync"] is not None and out["small"] == out["sync"] and out["sync again"] == out["sync"], out
