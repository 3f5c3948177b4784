"""Incremental checkpoints through the checkpointer: chains, per-tensor choice, restart, retention, failure, CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_env import cli
from conftest import run_python
from property_states import difference

import asyncckpt
from asyncckpt._manifest import read_manifest


def _trainer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "noise": torch.randn(4096)}  # fmt: skip


def _snapshot(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return type(state)((k, _snapshot(v)) for k, v in state.items())
    if isinstance(state, list):
        return [_snapshot(v) for v in state]
    return state


def _delta_keys(path: Path) -> dict[str, str | None]:
    return {t.key: t.delta for t in read_manifest(path).tensors}


@pytest.mark.parametrize("reference", ["full", "previous"])
def test_a_chain_longer_than_k_restores_every_step_bit_for_bit(run_dir: Path, reference: str) -> None:
    model, opt = _trainer()
    expected = {}
    with asyncckpt.AsyncCheckpointer(run_dir, delta="on", delta_full_every=3, delta_reference=reference) as ckpt:
        for step in range(1, 9):
            _train(model, opt)
            state = _state(model, opt, step)
            handle = ckpt.save(step, state)
            expected[step] = _snapshot(state)
            state["noise"].add_(1.0)  # mutated right after save() returned: the checkpoint must not see it
            handle.result()
    versions = {step: read_manifest(run_dir / f"step-{step:010d}").format_version for step in expected}
    assert versions == {1: 3, 2: 4, 3: 4, 4: 3, 5: 4, 6: 4, 7: 3, 8: 4}, "a full checkpoint every 3 saves"
    for step, state in expected.items():
        assert difference(state, asyncckpt.load(run_dir, step=step)) is None, step
        asyncckpt.verify(run_dir, step=step)
    bases = {step: read_manifest(run_dir / f"step-{step:010d}").reference for step in expected}
    depth_one = all(read_manifest(run_dir / f"step-{b.step:010d}").reference is None for b in bases.values() if b)
    assert depth_one == (reference == "full"), "with 'full' every delta refers to a full checkpoint: two reads at most"
    base = 4 if reference == "full" else 5  # the chain's full save, or the save before
    manifest = read_manifest(run_dir / "step-0000000006")
    assert manifest.reference is not None and manifest.reference.step == base
    assert manifest.reference.manifest_sha256 == read_manifest(run_dir / f"step-{base:010d}").digest
    keys = _delta_keys(run_dir / "step-0000000006")
    assert keys["model/0.weight"] in ("xor", "sub"), "slowly drifting weights are stored as deltas"
    assert keys["noise"] is None, "a tensor whose delta does not pay is stored on its own"
    assert manifest.stored_bytes < read_manifest(run_dir / "step-0000000004").stored_bytes


def test_the_first_save_of_a_new_checkpointer_is_full_and_chains_restore_after_restart(run_dir: Path) -> None:
    model, opt = _trainer(1)
    saved = {}
    with asyncckpt.AsyncCheckpointer(run_dir, delta="on") as ckpt:
        for step in (1, 2, 3):
            _train(model, opt)
            saved[step] = _snapshot(_state(model, opt, step))
            ckpt.save(step, saved[step]).result()
    with asyncckpt.AsyncCheckpointer(run_dir, delta="auto") as ckpt:
        restored = asyncckpt.load(run_dir)
        assert difference(saved[3], restored) is None
        model.load_state_dict(restored["model"])
        _train(model, opt)
        saved[4] = _snapshot(_state(model, opt, 4))
        ckpt.save(4, saved[4]).result()
        _train(model, opt)
        saved[5] = _snapshot(_state(model, opt, 5))
        ckpt.save(5, saved[5], full=True).result()
    assert read_manifest(run_dir / "step-0000000004").reference is None, "a new checkpointer has no reference"
    assert read_manifest(run_dir / "step-0000000005").reference is None, "full=True"
    for step, state in saved.items():
        assert difference(state, asyncckpt.load(run_dir, step=step)) is None


def test_retention_keeps_every_base_a_kept_checkpoint_needs(run_dir: Path) -> None:
    model, opt = _trainer(2)
    last = None
    with asyncckpt.AsyncCheckpointer(run_dir, delta="on", delta_full_every=4, keep_last=1) as ckpt:
        for step in range(1, 7):
            _train(model, opt)
            last = _snapshot(_state(model, opt, step))
            ckpt.save(step, last).result()
    # Step 5 is full (every 4th save), 6 a delta on it: keep_last=1 keeps 6 and its base 5; 1-4 go.
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [5, 6]
    assert read_manifest(run_dir / "step-0000000006").reference is not None
    assert difference(last, asyncckpt.load(run_dir)) is None


def test_a_corrupt_or_missing_base_fails_every_dependent(run_dir: Path) -> None:
    model, opt = _trainer(3)
    with asyncckpt.AsyncCheckpointer(run_dir, delta="on", delta_full_every=8, delta_reference="previous") as ckpt:
        for step in (1, 2, 3):
            _train(model, opt)
            ckpt.save(step, _state(model, opt, step)).result()
    data = run_dir / "step-0000000001" / "data-0.bin"
    offset = next(t.offset for t in read_manifest(data.parent).tensors if t.key == "model/0.weight")
    raw = bytearray(data.read_bytes())
    raw[offset + 10] ^= 0x40
    data.write_bytes(bytes(raw))
    for step in (2, 3):
        for reader in (asyncckpt.load, asyncckpt.verify):
            with pytest.raises(asyncckpt.CorruptCheckpointError, match=r"delta against step \d.*step-0000000001"):
                reader(run_dir, step=step)
    (run_dir / "step-0000000002" / "manifest.json").unlink()
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="delta against step 2"):
        asyncckpt.verify(run_dir / "step-0000000003")


_FAILED_SAVE = """
import json, resource, signal, sys, torch
import asyncckpt
from asyncckpt._manifest import read_manifest
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
gen = torch.Generator().manual_seed(0)
w = torch.randn(200_000, generator=gen)
ckpt = asyncckpt.AsyncCheckpointer(sys.argv[1], delta="on", delta_full_every=16)
def state():
    w.add_(torch.randn(200_000, generator=gen) * 1e-6)
    return {"w": w.clone()}
ckpt.save(1, state()).result()
ckpt.save(2, state()).result()
limits = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, limits[1]))  # a real write failure: the file may not grow
failed = ckpt.save(3, state())
try:
    failed.result(60)
    out = {"failed": False}
except asyncckpt.SaveFailedError as exc:
    out = {"failed": True, "message": str(exc)}
resource.setrlimit(resource.RLIMIT_FSIZE, limits)
try:
    ckpt.save(4, state())
except asyncckpt.SaveFailedError:
    out["raised_once"] = True
expected = state()
ckpt.save(5, expected).result()
nxt = state()
ckpt.save(6, nxt).result()
ckpt.close()
out["v5"] = read_manifest(ckpt.directory / "step-0000000005").format_version
out["ref6"] = read_manifest(ckpt.directory / "step-0000000006").reference.step
out["equal5"] = bool(torch.equal(asyncckpt.load(sys.argv[1], step=5)["w"], expected["w"]))
out["equal6"] = bool(torch.equal(asyncckpt.load(sys.argv[1], step=6)["w"], nxt["w"]))
print(json.dumps(out))
"""


def test_after_a_failed_save_the_next_save_is_full(run_dir: Path) -> None:
    proc = run_python(_FAILED_SAVE, str(run_dir))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failed"] and "File too large" in out["message"], out
    assert out["raised_once"] and out["v5"] == 3 and out["ref6"] == 5, out
    assert out["equal5"] and out["equal6"], out


def test_discard_steps_after_makes_the_next_save_full(run_dir: Path) -> None:
    model, opt = _trainer(4)
    with asyncckpt.AsyncCheckpointer(run_dir, delta="on") as ckpt:
        for step in (1, 2, 3):
            _train(model, opt)
            ckpt.save(step, _state(model, opt, step)).result()
        assert ckpt.discard_steps_after(1) == [2, 3]
        _train(model, opt)
        again = _snapshot(_state(model, opt, 2))
        ckpt.save(2, again).result()
    assert read_manifest(run_dir / "step-0000000002").reference is None
    assert difference(again, asyncckpt.load(run_dir)) is None


def test_ls_shows_the_base_and_convert_flattens_a_delta(run_dir: Path, tmp_path: Path) -> None:
    model, opt = _trainer(5)
    with asyncckpt.AsyncCheckpointer(run_dir, delta="on") as ckpt:
        for step in (1, 2):
            _train(model, opt)
            last = _snapshot(_state(model, opt, step))
            ckpt.save(step, last).result()
    listing = json.loads(cli("ls", run_dir, "--json").stdout)["checkpoints"]
    assert [(r["step"], r["delta"], r["base_step"]) for r in listing] == [(1, False, None), (2, True, 1)]
    assert listing[1]["delta_tensors"] > 0
    text = cli("ls", run_dir).stdout
    assert "delta:1" in text and "full" in text
    out = tmp_path / "flat"
    proc = cli("convert", run_dir / "step-0000000002", out)
    assert proc.returncode == 0, proc.stderr
    flat = read_manifest(out / "step-0000000002")
    assert flat.format_version == 3 and flat.reference is None and all(t.delta is None for t in flat.tensors)
    assert difference(last, asyncckpt.load(out)) is None


def test_options_and_env(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> None:
    with pytest.raises(ValueError, match="delta must be"):
        asyncckpt.AsyncCheckpointer(run_dir, delta="yes")
    with pytest.raises(ValueError, match="delta_full_every"):
        asyncckpt.AsyncCheckpointer(run_dir, delta="on", delta_full_every=65)
    monkeypatch.setenv("ASYNCCKPT_DELTA", "on")
    monkeypatch.setenv("ASYNCCKPT_DELTA_FULL_EVERY", "2")
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        assert (ckpt.options.delta, ckpt.options.delta_full_every) == ("on", 2)
        w = torch.linspace(0, 1, 10_000)
        for step in (1, 2, 3):
            ckpt.save(step, {"w": w + step * 1e-7}).result()
    assert [read_manifest(c.path).format_version for c in asyncckpt.list_checkpoints(run_dir)] == [3, 4, 3]


def test_the_reference_store_respects_its_budget(run_dir: Path) -> None:
    # auto: references share the budget with staging (400 KB here), so only w's 4 KB fit beside it.
    w, big = torch.linspace(0, 1, 1000), torch.linspace(0, 1, 100_000)
    with asyncckpt.AsyncCheckpointer(run_dir, delta="auto", host_staging_budget_bytes=440_000) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": w + step * 1e-7, "big": big + step * 1e-7}).result()
        assert ckpt._delta is not None and ckpt._delta.store.held_bytes == 4000  # type: ignore[attr-defined]
    keys = _delta_keys(run_dir / "step-0000000002")
    assert keys["w"] is not None and keys["big"] is None, "a tensor whose reference does not fit is stored in full"
