"""Native distributed checkpoints: 2 real ranks (separate processes, gloo), commit only when both parts are durable.

Each test starts one Python process per rank; they meet in a gloo process group (file store) and share the run
directory, as ranks of a torchrun job would on a shared file system.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import REPO

import asyncckpt
from asyncckpt._layout import LATEST_NAME, pointer_reaches
from asyncckpt.distributed import DistributedCheckpointer, load_rank
from asyncckpt.distributed._protocol import RankContext, _wait_for_commit

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

_PRELUDE = """
import json, os, resource, signal, sys, time
import torch, torch.distributed as dist
import asyncckpt
from asyncckpt.distributed import DistributedCheckpointer
rank, world, root, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
def state_of(step):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return {"w": torch.randn(50_000, generator=gen), "ids": torch.arange(1000) * (rank + 1), "rank": rank,
            "step": step}
def report(**values):
    print("RESULT " + json.dumps(values), flush=True)
"""

_ROUNDTRIP = (
    _PRELUDE
    + """
with DistributedCheckpointer(root, keep_last=2) as ckpt:
    for step in (1, 2, 3):
        state = state_of(step)
        handle = ckpt.save(step, state, metadata={"rank": rank})
        state["w"].add_(1000.0)  # mutate right after save() returns: the checkpoint must not see it
        result = handle.result(timeout=60)
    mine = ckpt.load()
report(path=str(result.path), raw_bytes=result.raw_bytes, mode=result.snapshot_mode, why=result.snapshot_reason,
       stages=sorted(result.stage_seconds), equal=bool(torch.equal(mine["w"], state_of(3)["w"])),
       ids=bool(torch.equal(mine["ids"], state_of(3)["ids"])), rank_field=mine["rank"], step_field=mine["step"])
with DistributedCheckpointer(root + "-replica", replicated=True) as replica:
    replica.save(7, state_of(7) if rank == 0 else {"ignored": torch.zeros(3)}).result(timeout=60)
    got = replica.load()
report(replica_rank=got["rank"], replica_equal=bool(torch.equal(got["w"], (lambda: (
    torch.randn(50_000, generator=torch.Generator().manual_seed(7))))())))
"""
)

_FAILING_RANK = (
    _PRELUDE
    + """
ckpt = DistributedCheckpointer(root, commit_timeout_seconds=30)
ckpt.save(1, state_of(1)).result(timeout=60)
if rank == 1:
    # A real write failure on this rank only: files may not grow past 4 KiB (EFBIG), as on a full quota.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))
handle = ckpt.save(2, state_of(2))
try:
    handle.result(timeout=60)
    report(failed=False)
except asyncckpt.SaveFailedError as error:
    report(failed=True, message=str(error), cause=str(error.__cause__))
if rank == 1:
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)
try:
    ckpt.save(3, state_of(3))
    report(next_save_raised=False)
except asyncckpt.SaveFailedError:
    report(next_save_raised=True)  # the failure is raised once more, by the next save()
handle = ckpt.save(3, state_of(3))
report(recovered=str(handle.result(timeout=60).path))
ckpt.close()
"""
)

_DEAD_RANK = (
    _PRELUDE
    + """
dead = int(os.environ["DEAD_RANK"])
ckpt = DistributedCheckpointer(root, commit_timeout_seconds=2)
ckpt.save(1, state_of(1)).result(timeout=60)
if rank == dead:
    print("dying", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
began = time.monotonic()
try:
    ckpt.save(2, state_of(2)).result(timeout=60)
    report(failed=False)
except asyncckpt.SaveFailedError as error:
    report(failed=True, message=str(error), cause=str(error.__cause__), waited=time.monotonic() - began)
os._exit(0)  # the process group has a dead member: skip its shutdown handshake
"""
)


def _run_ranks(code: str, root: Path, tmp_path: Path, env: dict[str, str] | None = None,
               world: int = 2) -> list[tuple[int, list[dict], str]]:  # fmt: skip
    store = tmp_path / "store"
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), str(world), str(root), str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            cwd=REPO,
        )
        for rank in range(world)
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=100)
        results = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
        out.append((proc.returncode, results, stdout + stderr))
    return out


def _merged(results: list[dict]) -> dict:
    merged: dict = {}
    for r in results:
        merged.update(r)
    return merged


def test_two_ranks_save_and_each_loads_its_own_part(tmp_path: Path) -> None:
    root = tmp_path / "run"
    ranks = _run_ranks(_ROUNDTRIP, root, tmp_path)
    for rank, (code, results, output) in enumerate(ranks):
        assert code == 0, output
        got = _merged(results)
        assert got["equal"] and got["ids"], f"rank {rank} did not get its own step-3 state back"
        assert got["rank_field"] == rank and got["step_field"] == 3
        assert got["replica_rank"] == 0 and got["replica_equal"], "a replicated save must give every rank rank 0's"
        assert got["path"] == str(root / "step-0000000003")
        # The result is the single-process one's: which snapshot mode ran and why, every stage timed.
        assert got["mode"] == "host" and "host memory" in got["why"], got
        assert {"snapshot", "commit"} <= set(got["stages"]), got
    # One committed directory per step, one data file per rank, retention applied by rank 0, nothing temporary.
    assert [c.step for c in asyncckpt.list_checkpoints(root)] == [2, 3]
    assert sorted(p.name for p in (root / "step-0000000003").iterdir()) == ["data-r0.bin", "data-r1.bin",
                                                                            "manifest.json"]  # fmt: skip
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    # Single-process tools read it too: verify checks every rank's blobs, load returns {rank: state}.
    report = asyncckpt.verify(root)
    assert report.step == 3 and report.tensors == 4
    everything = asyncckpt.load(root)
    assert sorted(everything) == [0, 1]
    assert torch.equal(everything[1]["ids"], torch.arange(1000) * 2)
    assert torch.equal(load_rank(root, 1)["ids"], everything[1]["ids"])
    replica = tmp_path / "run-replica" / "step-0000000007"
    assert sorted(p.name for p in replica.iterdir()) == ["data-r0.bin", "manifest.json"]


def test_a_failing_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "run"
    ranks = _run_ranks(_FAILING_RANK, root, tmp_path)
    for rank, (code, results, output) in enumerate(ranks):
        assert code == 0, output
        got = _merged(results)
        assert got["failed"], f"rank {rank}: the save of step 2 must fail on every rank"
        assert "rank 1 failed" in got["cause"] or "File too large" in got["cause"], got
        assert "latest good checkpoint is unchanged" in got["message"]
        assert got["next_save_raised"]
        assert got["recovered"] == str(root / "step-0000000003")
    assert [c.step for c in asyncckpt.list_checkpoints(root)] == [1, 3]
    assert not (root / "step-0000000002").exists()
    assert not list(root.glob(".tmp-*")), "the aborted save's temporary directory must be removed"


@pytest.mark.parametrize("dead", [1, 0], ids=["follower-killed", "committer-killed"])
def test_a_killed_rank_times_out_with_a_clear_error(tmp_path: Path, dead: int) -> None:
    root = tmp_path / "run"
    ranks = _run_ranks(_DEAD_RANK, root, tmp_path, env={"DEAD_RANK": str(dead)})
    code, _, output = ranks[dead]
    assert code == -9 and "dying" in output
    code, results, output = ranks[1 - dead]
    assert code == 0, output
    got = _merged(results)
    assert got["failed"], output
    if dead == 1:
        assert "ranks [1] did not report their part within 2 s" in got["cause"]
        assert 2 <= got["waited"] < 30
    else:
        assert "rank 0 (the committer) neither committed nor aborted" in got["cause"]
        assert 4 <= got["waited"] < 30
    assert asyncckpt.latest_step(root) == 1
    assert not (root / "step-0000000002").exists()


def _two_ranks_in_process(root: Path, **options: object) -> list[DistributedCheckpointer]:
    return [DistributedCheckpointer(root, rank=r, world_size=2, session="s1", **options) for r in (0, 1)]  # type: ignore[arg-type]


def test_a_follower_returns_only_once_latest_names_the_committed_step(tmp_path: Path) -> None:
    """The window between rank 0's rename and its pointer update: the follower must wait it out.

    Reproduced on disk exactly: two real saves commit steps 2 and 3, then ``latest`` is put back
    to step 2, the state a follower saw in CI when it returned early and its load("latest") read step 2.
    """
    root = tmp_path / "run"
    ranks = _two_ranks_in_process(root)
    for step in (2, 3):
        handles = [ckpt.save(step, {"x": torch.full((4,), float(step))}) for ckpt in ranks]
        for handle in handles:
            handle.result(timeout=30)
    for ckpt in ranks:
        ckpt.close()
    pointer = root / LATEST_NAME
    pointer.write_text("step-0000000002\n")
    ctx = RankContext(rank=1, world_size=2, session="s1", writers=(0, 1), commit_timeout_seconds=10)
    outcome: list[Path] = []
    waiter = threading.Thread(target=lambda: outcome.append(_wait_for_commit(root, 3, ctx)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not outcome, "the follower returned while latest still named step 2"
    scratch = root / ".latest.writing"
    scratch.write_text("step-0000000003\n")
    os.replace(scratch, pointer)  # what commit() does next
    waiter.join(5)
    assert outcome == [root / "step-0000000003"]
    assert torch.equal(load_rank(root, 1)["x"], torch.full((4,), 3.0))


def test_a_follower_accepts_a_commit_whose_pointer_rank0_never_moved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0 died between rename and pointer: the step is committed, so the follower succeeds and says so."""
    root = tmp_path / "run"
    ranks = _two_ranks_in_process(root)
    for step in (2, 3):
        for handle in [ckpt.save(step, {"x": torch.zeros(2)}) for ckpt in ranks]:
            handle.result(timeout=30)
    for ckpt in ranks:
        ckpt.close()
    (root / LATEST_NAME).write_text("step-0000000002\n")
    ctx = RankContext(rank=1, world_size=2, session="s1", writers=(0, 1), commit_timeout_seconds=0.2)
    with caplog.at_level("WARNING", logger="asyncckpt"):
        assert _wait_for_commit(root, 3, ctx) == root / "step-0000000003"
    assert "still names an earlier step" in caplog.text
    assert not pointer_reaches(root, 3) and pointer_reaches(root, 2)
