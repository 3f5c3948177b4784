"""The GPU path end to end on real training: every snapshot mode keeps the bit-for-bit invariant
while the optimizer steps right after ``save()``; restores land on the GPU and are verified
there; GPU-written standard codecs load on a CPU-only machine, GPU-only ones fail there with
an error that says so; ``convert`` makes them readable."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest
import torch
from conftest import run_python
from gpu_env import Trainer, requires_gpu, subprocess_env

import asyncckpt
from asyncckpt._manifest import read_manifest
from asyncckpt.cli import main as cli
from asyncckpt.testing.state_compare import clone_state, first_difference

pytestmark = requires_gpu

MODES = [
    ("device", "auto"),
    ("device", "auto+kvikio-compat"),  # compat-mode I/O through KvikIO's pool instead of the pinned writer
    ("fence", "auto"),
    ("host", "auto"),
    ("auto", "auto"),
    ("device", "zstd"),
    ("fence", "ans"),
    ("device", "none"),
    ("fence", "bitcomp"),
]


def _tensors(state: object) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


@pytest.mark.parametrize(("snapshot", "codec"), MODES)
def test_optimizer_steps_right_after_save_never_tear_a_checkpoint(
    run_dir: Path, snapshot: str, codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if codec.endswith("+kvikio-compat"):
        monkeypatch.setenv("ASYNCCKPT_COMPAT_IO", "kvikio")
        codec = codec.split("+")[0]
    trainer = Trainer(width=128, layers=2, autocast=True)
    references = {}
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot=snapshot, codec=codec, max_inflight=2) as ckpt:
        handles = []
        for step in range(1, 7):
            trainer.backward()
            state = trainer.state(grads=True)
            references[step] = clone_state(state)
            handles.append(ckpt.save(step, state, metadata={"step": step}))
            trainer.optimizer.step()  # mutates weights and moments at once: the fence must hold it on the GPU
            trainer.optimizer.step()
        results = [h.result(timeout=120) for h in handles]
    for result in results:
        assert result.io_mode in ("gds", "compat")
        assert result.snapshot_mode == (snapshot if snapshot != "auto" else "device")
        if codec == "none":
            assert set(result.codecs) == {"none"}
        restored = asyncckpt.load(run_dir, step=result.step)
        assert first_difference(references[result.step], restored) is None, f"step {result.step}"
        for t in _tensors(restored["model"]):
            assert t.is_cuda
        assert read_manifest(result.path).io_mode == result.io_mode


def test_fence_copies_tiny_and_strided_views_before_the_step_that_overwrites_them(run_dir: Path) -> None:
    """In fence mode the compressor copies tiny and non-contiguous tensors (save() reads nothing of
    them); the optimizer step queued right after save() must still wait for those copies."""
    trainer = Trainer(width=128, layers=2, fused=True)  # fused AdamW: CUDA step counters of 4 bytes
    trainer.step()
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="fence", codec="auto", max_inflight=2) as ckpt:
        for step in (1, 2):
            trainer.backward()
            weights = {n: p.detach() for n, p in trainer.model.named_parameters()}
            state = {
                "optim": trainer.optimizer.state_dict(),
                "transposed": {n: w.t() for n, w in weights.items() if w.dim() == 2},  # live, non-contiguous
                "tiny": {n: w for n, w in weights.items() if w.nbytes < 4096},  # stored raw, read at write time
            }
            assert state["transposed"] and state["tiny"]
            reference = clone_state(state)
            handle = ckpt.save(step, state)
            for _ in range(3):
                trainer.optimizer.step()  # overwrites every weight, moment and step counter in place
            handle.result(120)
            assert first_difference(reference, asyncckpt.load(run_dir, step=step)) is None, f"step {step}"


def test_a_fence_save_is_staged_once_the_gpu_has_read_the_state(run_dir: Path) -> None:
    trainer = Trainer(width=128, layers=2)
    trainer.step()
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="fence", codec="ans") as ckpt:
        handle = ckpt.save(1, trainer.state())
        assert handle.wait_staged(60)
        assert handle.result(60).gpu_idle_seconds >= handle.stall_seconds


def test_odd_tensors_and_mixed_devices_round_trip_in_every_mode(run_dir: Path) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(300, 200, device="cuda", generator=gen)
    z = torch.randn(50_000, dtype=torch.complex64, device="cuda", generator=gen)
    state = {
        "transposed": base.t(),  # non-contiguous
        "strided": base[::3, 1::2],
        "empty": torch.empty(0, 5, device="cuda"),
        "scalar": torch.tensor(3.5, device="cuda", dtype=torch.float64),
        "mask": base > 0.5,
        "bf16": base.to(torch.bfloat16),
        "ints": torch.arange(100_000, device="cuda"),
        "cpu": torch.randn(50_000),
        "cpu_scalar": torch.tensor(7),
        "same": [base, base],  # one tensor twice: stored once, restored as one object
        "meta": {"lr": 1e-3, "name": "x"},
        "z": z,  # with lazy conjugate and negative views of its memory: other values, other leaves
        "conj": z.conj(),
        "neg_imag": z.conj().imag,
        "small_conj": z[:3].conj(),
        "cpu_conj": z[:3].cpu().conj(),
    }
    reference = clone_state(state)
    for i, snapshot in enumerate(("device", "fence", "host", "auto"), start=1):
        with asyncckpt.AsyncCheckpointer(run_dir / snapshot, snapshot=snapshot, codec="auto") as ckpt:
            ckpt.save(i, state).result(60)
        restored = asyncckpt.load(run_dir / snapshot)
        assert first_difference(reference, restored) is None, snapshot
        assert restored["cpu"].device.type == "cpu" and restored["ints"].is_cuda
        assert restored["same"][0] is restored["same"][1]
        assert torch.equal(restored["conj"], z.conj()) and torch.equal(restored["neg_imag"], -z.imag), snapshot


def test_corruption_is_caught_on_the_device_and_names_tensor_and_file(run_dir: Path) -> None:
    trainer = Trainer(width=128, layers=2)
    trainer.step()
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="device", codec="ans") as ckpt:
        path = ckpt.save(1, trainer.state()).result(60).path
    manifest = read_manifest(path)
    record = max(manifest.tensors, key=lambda r: r.stored_bytes)
    with open(path / record.file, "r+b") as f:
        f.seek(record.offset + record.stored_bytes // 2)
        byte = f.read(1)
        f.seek(record.offset + record.stored_bytes // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(asyncckpt.CorruptCheckpointError, match=rf"(?s){record.key}.*{record.file}.*crc32"):
        asyncckpt.load(run_dir)


@pytest.mark.parametrize("snapshot", ["device", "fence", "host"])
def test_every_gpu_written_blob_carries_zlibs_crc32_of_its_file_bytes(run_dir: Path, snapshot: str) -> None:
    trainer = Trainer(width=128, layers=2)
    trainer.step()
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot=snapshot, codec="auto") as ckpt:
        path = ckpt.save(1, trainer.state()).result(60).path
    manifest = read_manifest(path)
    assert {r.codec for r in manifest.tensors} - {"none"}, "nothing was compressed on the GPU"
    for record in manifest.tensors:
        with open(path / record.file, "rb") as f:
            f.seek(record.offset)
            stored = f.read(record.stored_bytes)
        assert record.checksum.algorithm == "crc32", record.key
        assert record.checksum.value == f"{zlib.crc32(stored):08x}", record.key


def test_a_cpu_written_checkpoint_restores_through_the_gpu(run_dir: Path) -> None:
    trainer = Trainer(width=128, layers=2)
    trainer.step()
    state = {"model": {k: v.cpu() for k, v in trainer.model.state_dict().items()}}
    with asyncckpt.AsyncCheckpointer(run_dir, snapshot="host", codec="zstd") as ckpt:
        assert ckpt.save(1, state).result(60).io_mode == "posix"
    restored = asyncckpt.load(run_dir, map_location="cuda")
    assert first_difference(state, restored) is None
    assert all(t.is_cuda for t in restored["model"].values())


_CPU_ONLY_LOAD = """
import sys, torch, asyncckpt
from asyncckpt.testing.state_compare import first_difference
assert not torch.cuda.is_available()
reference = torch.load(sys.argv[2], weights_only=True)
try:
    restored = asyncckpt.load(sys.argv[1], map_location="cpu")
except asyncckpt.CheckpointError as exc:
    print("ERROR:", exc)
else:
    print("DIFF:", first_difference(reference, restored))
"""


@pytest.mark.parametrize("codec", ["zstd", "lz4", "deflate", "ans"])
def test_gpu_written_checkpoints_on_a_cpu_only_machine(tmp_path: Path, codec: str) -> None:
    trainer = Trainer(width=128, layers=2, autocast=True)
    trainer.step()
    state = trainer.state()
    torch.save(clone_state(state), tmp_path / "reference.pt")
    with asyncckpt.AsyncCheckpointer(tmp_path / "run", snapshot="device", codec=codec) as ckpt:
        ckpt.save(1, state).result(60)
    env = subprocess_env(CUDA_VISIBLE_DEVICES="")
    out = run_python(_CPU_ONLY_LOAD, str(tmp_path / "run"), str(tmp_path / "reference.pt"), env=env).stdout
    if codec == "ans":
        assert "needs a CUDA GPU" in out and 'pip install "asyncckpt[cu12]"' in out and "convert" in out
        assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "zstd"), "--codec", "zstd"]) == 0
        out = run_python(_CPU_ONLY_LOAD, str(tmp_path / "zstd"), str(tmp_path / "reference.pt"), env=env).stdout
    assert "DIFF: None" in out, out


def test_convert_to_a_gpu_codec_and_to_safetensors(tmp_path: Path) -> None:
    trainer = Trainer(width=128, layers=2)
    trainer.step()
    state = trainer.state()
    reference = clone_state(state)
    with asyncckpt.AsyncCheckpointer(tmp_path / "run", codec="zstd", snapshot="host") as ckpt:
        ckpt.save(3, state).result(60)
    assert cli(["convert", str(tmp_path / "run"), str(tmp_path / "lz4"), "--codec", "lz4"]) == 0
    assert {r.codec for r in read_manifest(tmp_path / "lz4" / "step-0000000003").tensors} <= {"lz4", "none"}
    assert first_difference(reference, asyncckpt.load(tmp_path / "lz4")) is None
    assert cli(["convert", str(tmp_path / "lz4"), str(tmp_path / "s.safetensors"), "--to", "safetensors"]) == 0
    assert (tmp_path / "s.safetensors").stat().st_size > 8


def test_the_demo_runs_on_the_gpu_path(tmp_path: Path) -> None:
    assert cli(["demo", "--dir", str(tmp_path / "demo"), "--steps", "20", "--save-every", "5", "--width", "64"]) == 0
    assert read_manifest(asyncckpt.list_checkpoints(tmp_path / "demo")[-1].path).io_mode in ("gds", "compat")


def test_fence_without_a_codec_is_refused(run_dir: Path) -> None:
    with pytest.raises(asyncckpt.CheckpointError, match="fence"):
        asyncckpt.AsyncCheckpointer(run_dir, snapshot="fence", codec="none")


def test_kvikio_threads_follow_io_threads(run_dir: Path) -> None:
    from asyncckpt._gpu.deps import kvikio
    from asyncckpt._gpu.storage import DEFAULT_TASK_BYTES

    with asyncckpt.AsyncCheckpointer(run_dir, codec="ans", io_threads=4) as ckpt:
        assert ckpt._backend.storage.threads == 4  # type: ignore[attr-defined]
        if not os.environ.get("KVIKIO_TASK_SIZE"):  # larger tasks: fewer driver calls beside training
            assert int(kvikio().defaults.get("task_size")) == DEFAULT_TASK_BYTES
        ckpt.save(1, {"w": torch.randn(1 << 20, device="cuda")}).result(60)
