"""Hugging Face: a real tiny Trainer (GPT-2 built from a config, no downloads) saving through asyncckpt, and a
resume from its checkpoint that ends bit-for-bit where the uninterrupted run ended."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import asyncckpt  # noqa: E402
from asyncckpt.integrations.huggingface import AsyncCkptTrainer  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _model() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def _data() -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in tokens]


def _trainer(out: Path, max_steps: int = 6) -> AsyncCkptTrainer:
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=3,
                                          per_device_train_batch_size=4, report_to=[], use_cpu=True, seed=0,
                                          logging_steps=100, disable_tqdm=True)  # fmt: skip
    return AsyncCkptTrainer(model=_model(), args=args, train_dataset=_data(), asyncckpt_options={"codec": "zstd"})


def test_trainer_saves_through_asyncckpt_and_resumes_exactly(tmp_path: Path) -> None:
    straight = _trainer(tmp_path / "a")
    straight.train()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["checkpoint-3", "checkpoint-6"]
    checkpoint = tmp_path / "a" / "checkpoint-3"
    # No torch.save files: model, optimizer, scheduler and RNG states are one asyncckpt checkpoint, committed
    # atomically together with the Trainer's own JSON state.
    assert sorted(p.name for p in checkpoint.iterdir()) == ["data-0.bin", "manifest.json", "trainer_state.json"]
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 3
    asyncckpt.verify(checkpoint)
    saved = asyncckpt.load(checkpoint)
    assert set(saved) == {"model", "optimizer", "scheduler", "rng"}

    resumed = _trainer(tmp_path / "b")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6
    for key, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), f"{key}: the resumed run diverged"

    latest = _trainer(tmp_path / "a", max_steps=6)
    latest.train(resume_from_checkpoint=True)  # get_last_checkpoint finds the asyncckpt checkpoint-6
    assert latest._asyncckpt_resumed is not None
    assert latest._asyncckpt_resumed["_path"] == str(tmp_path / "a" / "checkpoint-6")
    for trainer in (straight, resumed, latest):
        trainer.close_checkpointer()
