"""Delta chains read as hostile input; a property round trip through a chain; per-rank deltas with real gloo ranks."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_states import difference, states
from test_distributed import _PRELUDE, _run_ranks

import asyncckpt
from asyncckpt._manifest import MANIFEST_NAME, read_manifest
from asyncckpt._manifest_digest import DIGEST_FIELD, seal


def _chain(root: Path, steps: int = 4) -> None:
    w = torch.linspace(0, 1, 20_000)
    with asyncckpt.AsyncCheckpointer(root, delta="on", delta_full_every=8, delta_reference="previous") as ckpt:
        for step in range(1, steps + 1):
            ckpt.save(step * 10, {"w": w + step * 1e-7, "i": torch.arange(5000) + step}).result()


def _rewrite(checkpoint: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = checkpoint / MANIFEST_NAME
    doc = json.loads(path.read_bytes())
    del doc[DIGEST_FIELD]
    change(doc)
    path.write_bytes(seal(doc))


def _set_reference(**fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["reference"].update(fields)


def _retype_w(doc: dict[str, Any]) -> None:
    for record in doc["tensors"]:
        if record["key"] == "w":
            record["dtype"] = "int32"


HOSTILE = {
    "reference to a higher step": (_set_reference(step=40), "not below the checkpoint's own step"),
    "reference to itself": (_set_reference(step=30), "not below"),
    "missing base": (_set_reference(step=5), "base checkpoint \\(step 5\\) is missing"),
    "digest mismatch": (_set_reference(manifest_sha256="0" * 64), "was written against"),
    "malformed digest": (_set_reference(manifest_sha256="xyz"), "64 lowercase hex"),
    "delta without reference": (lambda d: d.update(reference=None), "delta records but no reference"),
    "unknown op": (lambda d: d["tensors"][0].update(delta="add"), "unknown delta op"),
    "no such key in the base": (lambda d: [t.update(key="other") for t in d["tensors"]], "has no record of 'other'"),
    "dtype differs from the base": (_retype_w, "delta against it is int32"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_v4_manifests_are_corrupt_in_load_and_verify(case: str, tmp_path: Path) -> None:
    _chain(tmp_path)
    change, message = HOSTILE[case]
    target = tmp_path / "step-0000000030"
    assert read_manifest(target).format_version == 4
    _rewrite(target, change)
    for reader in (asyncckpt.load, asyncckpt.verify):
        with pytest.raises(asyncckpt.CorruptCheckpointError, match=message):
            reader(target)


def test_a_replaced_base_is_named_with_its_dependent(tmp_path: Path) -> None:
    _chain(tmp_path)
    _rewrite(tmp_path / "step-0000000020", lambda d: d["metadata"].update(edited=True))  # resealed: a new digest
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="step-0000000030.*delta against step 20.*replaced"):
        asyncckpt.verify(tmp_path / "step-0000000030")
    assert asyncckpt.verify(tmp_path / "step-0000000020")  # the base itself is a valid checkpoint


def test_a_chain_longer_than_the_limit_is_refused(tmp_path: Path) -> None:
    from asyncckpt import _delta_chain as delta_chain

    _chain(tmp_path, steps=4)
    limit = delta_chain.MAX_CHAIN_DEPTH
    try:
        delta_chain.MAX_CHAIN_DEPTH = 2  # the writer's chain here is 3 long
        with pytest.raises(asyncckpt.CorruptCheckpointError, match="more than 2 delta checkpoints"):
            asyncckpt.load(tmp_path, step=40)
        assert asyncckpt.load(tmp_path, step=30) is not None
    finally:
        delta_chain.MAX_CHAIN_DEPTH = limit


def _drift(state: Any, seed: int) -> Any:
    """The state with some tensors' bytes changed a little (a few bytes flipped), as training would."""
    gen = torch.Generator().manual_seed(seed)
    if isinstance(state, torch.Tensor):
        if state.numel() == 0 or torch.rand(1, generator=gen).item() < 0.3:
            return state
        raw = state.detach().clone().contiguous().reshape(-1).view(torch.uint8)
        index = torch.randint(0, raw.numel(), (max(1, raw.numel() // 50),), generator=gen)
        raw[index] ^= 1
        if state.dtype is torch.bool:
            raw &= 1
        return raw.view(state.dtype).reshape(state.shape)
    if isinstance(state, dict):
        return type(state)((k, _drift(v, seed + i)) for i, (k, v) in enumerate(state.items()))
    if isinstance(state, (list, tuple)):
        return type(state)(_drift(v, seed + i) for i, v in enumerate(state)) if not hasattr(state, "_fields") else state
    return state


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@given(state=states(max_leaves=8), full_every=st.integers(1, 3), reference=st.sampled_from(["full", "previous"]))
def test_random_states_round_trip_through_a_chain(state: Any, full_every: int, reference: str) -> None:
    with tempfile.TemporaryDirectory(prefix="asyncckpt-delta-") as tmp:
        saved = []
        with asyncckpt.AsyncCheckpointer(tmp, delta="on", delta_full_every=full_every,
                                         delta_reference=reference) as ckpt:  # fmt: skip
            for step in range(1, 5):
                current = state if step == 1 else _drift(saved[-1], step)
                saved.append(current)
                ckpt.save(step, current).result()
        for step, expected in enumerate(saved, start=1):
            found = difference(expected, asyncckpt.load(tmp, step=step))
            assert found is None, f"step {step}: {found}"


def _rank_results(code: str, root: Path, tmp_path: Path) -> list[tuple[int, dict]]:
    """Run ``code`` on two gloo ranks; each rank's last report, after checking every rank exited cleanly."""
    results = []
    for rank, (returncode, found, output) in enumerate(_run_ranks(code, root, tmp_path)):
        assert returncode == 0 and found, output
        results.append((rank, found[-1]))
    return results


_DISTRIBUTED = (
    _PRELUDE
    + """
from asyncckpt.distributed import load_rank
from asyncckpt._manifest import read_manifest
w = torch.linspace(0, 1, 30_000) * (rank + 1)
saved = {}
with DistributedCheckpointer(root, delta="on", delta_full_every=3, keep_last=1) as ckpt:
    for step in range(1, 6):
        w.add_(1e-7 * step)
        saved[step] = {"w": w.clone(), "rank": rank, "ids": torch.arange(2000) * (rank + 1) + step}
        ckpt.save(step, saved[step]).result(timeout=60)
steps = [c.step for c in asyncckpt.list_checkpoints(root)]
equal = {s: bool(torch.equal(load_rank(root, rank, step=s)["w"], saved[s]["w"])) for s in steps}
manifests = {s: read_manifest(ckpt.directory / f"step-{s:010d}") for s in steps}
report(steps=steps, equal=equal, versions={s: m.format_version for s, m in manifests.items()},
       refs={s: m.reference.step if m.reference else None for s, m in manifests.items()},
       files=sorted({t.file for t in manifests[5].tensors if t.delta}))
"""
)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_distributed_ranks_refer_to_their_own_previous_data(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for rank, out in _rank_results(_DISTRIBUTED, root, tmp_path):
        # Steps 4 (full) and 5 (its delta): keep_last=1 keeps 5 and the base it needs.
        assert out["steps"] == [4, 5], out
        assert all(out["equal"].values()), (rank, out)
        assert out["versions"] == {"4": 3, "5": 4} and out["refs"] == {"4": None, "5": 4}, out
        assert out["files"] == ["data-r0.bin", "data-r1.bin"], out
    assert asyncckpt.verify(root).step == 5


_SKIPPED_DISCARD = (
    _PRELUDE
    + """
from asyncckpt.errors import SaveFailedError
from asyncckpt._manifest import read_manifest
w = torch.linspace(0, 1, 30_000) * (rank + 1)
outcome = {}
with DistributedCheckpointer(root, delta="on", delta_full_every=10, delta_reference="previous") as ckpt:
    for step in (1, 2, 3):
        w.add_(1e-7 * step)
        ckpt.save(step, {"w": w}).result(timeout=60)
    dist.barrier()  # every rank has seen step 3 committed before any of it is deleted
    if rank == 0:  # the mistake under test: only rank 0 restarts the timeline; rank 1 still refers to step 3
        ckpt.discard_steps_after(1)
    dist.barrier()
    w.add_(1e-7)
    try:
        ckpt.save(5, {"w": w}).result(timeout=60)
        outcome["first"] = "saved"
    except SaveFailedError as exc:
        outcome["first"] = str(exc)
    dist.barrier()
    for step in (6, 7):  # the failure may be raised once more by the next save(), as documented
        try:
            ckpt.save(step, {"w": w}).result(timeout=60)
        except SaveFailedError:
            continue
        outcome["saved"] = step
        outcome["full"] = read_manifest(ckpt.directory / f"step-{step:010d}").reference is None
        outcome["loads"] = bool(torch.equal(ckpt.load(step=step)["w"], w))
        break
report(**outcome, steps=[c.step for c in asyncckpt.list_checkpoints(root)])
"""
)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rank_encoding_against_a_discarded_step_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for rank, out in _rank_results(_SKIPPED_DISCARD, root, tmp_path):
        assert "no longer the one it was encoded against" in out["first"], (rank, out)
        assert out["full"] is True and out["loads"] is True, (rank, out)
        assert out["steps"] == [1, out["saved"]], (rank, out)
    assert asyncckpt.verify(root).step in (6, 7)


def test_the_distributed_checkpointer_takes_deltas_against_the_save_before(tmp_path: Path) -> None:
    """Against the chain's full save each rank would pick its own full save, and a step whose ranks
    refer to different bases cannot commit: refused up front, and 'previous' is the default there."""
    from asyncckpt.distributed import DistributedCheckpointer

    with pytest.raises(asyncckpt.CheckpointError, match="delta_reference='previous'"):
        DistributedCheckpointer(tmp_path, rank=0, world_size=1, session="s", delta="on", delta_reference="full")
    with DistributedCheckpointer(tmp_path, rank=0, world_size=1, session="s", delta="on") as ckpt:
        assert ckpt.options.delta_reference == "previous"
