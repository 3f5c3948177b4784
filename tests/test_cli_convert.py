"""``asyncckpt convert``: exports that other tools load as they are, and only the codecs this machine can write.

Real subprocesses; the safetensors file is read back with the safetensors library and loaded into a
fresh model with ``load_state_dict`` (strict), tied weight included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_env import Tied, cli, cli_calls, saved_run

import asyncckpt
from asyncckpt._gpu.deps import gpu_path_installed
from asyncckpt.testing.state_compare import first_difference

safetensors_torch = pytest.importorskip("safetensors.torch")


def test_safetensors_export_loads_into_the_model(tmp_path: Path) -> None:
    model = saved_run(tmp_path / "run")
    out = tmp_path / "model.safetensors"
    proc = cli("convert", tmp_path / "run", out, "--to", "safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "entry 'model'" in proc.stdout
    loaded = safetensors_torch.load_file(str(out))
    assert set(loaded) == set(model.state_dict())  # no model/ prefix, the tied head.weight present
    fresh = Tied()
    fresh.load_state_dict(loaded)  # strict: every key, right shapes
    assert first_difference(model.state_dict(), fresh.state_dict()) is None
    with safetensors_torch.safe_open(str(out), "pt") as f:
        assert f.metadata()["asyncckpt_step"] == "2" and f.metadata()["asyncckpt_key"] == "model"


def test_safetensors_export_of_another_entry_and_torch_export(tmp_path: Path) -> None:
    saved_run(tmp_path / "run")
    state = asyncckpt.load(tmp_path / "run")
    optim, whole = tmp_path / "optim.safetensors", tmp_path / "state.pt"
    exported, missing, saved = cli_calls(
        ["convert", tmp_path / "run", optim, "--to", "safetensors", "--key", "optim"],
        ["convert", tmp_path / "run", tmp_path / "x.safetensors", "--to", "safetensors", "--key", "nope"],
        ["convert", tmp_path / "run", whole, "--to", "torch"],
    )
    assert exported.returncode == 0 and saved.returncode == 0, (exported.stderr, saved.stderr)
    loaded = safetensors_torch.load_file(str(optim))
    assert torch.equal(loaded["state.0.exp_avg"], state["optim"]["state"][0]["exp_avg"])
    assert missing.returncode == 2 and "no entry 'nope'" in missing.stderr and "model" in missing.stderr

    back = torch.load(whole, weights_only=True)
    assert first_difference(state, back) is None and back["step"] == 2
    assert back["model"]["head.weight"] is back["model"]["embed.weight"] or (
        back["model"]["head.weight"].data_ptr() == back["model"]["embed.weight"].data_ptr()
    )  # tied stays tied


def test_convert_offers_only_codecs_this_machine_writes(tmp_path: Path) -> None:
    if gpu_path_installed():
        pytest.skip("this machine has the GPU path: every codec is offered")
    saved_run(tmp_path / "run")
    codecs = ("lz4", "deflate", "ans")
    runs = [["convert", tmp_path / "run", tmp_path / c, "--codec", c] for c in ("none", *codecs)]
    help_run, ok, *refused = cli_calls(["convert", "--help"], *runs)
    usage = " ".join(help_run.stdout.split())
    assert "{zstd,none}" in usage and "need a CUDA GPU and the GPU extra" in usage
    for codec, proc in zip(codecs, refused, strict=True):
        assert proc.returncode == 2 and "invalid choice" in proc.stderr and not (tmp_path / codec).exists()
    assert ok.returncode == 0, ok.stderr
    assert first_difference(asyncckpt.load(tmp_path / "run"), asyncckpt.load(tmp_path / "none")) is None
