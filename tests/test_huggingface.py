"""Hugging Face: a real tiny Trainer (GPT-2 built from a config, no downloads) saving through asyncckpt.

``checkpoint-N/`` must be what upstream's Trainer writes (model files, trainer state) with the training state in
``asyncckpt/``: ``from_pretrained`` reads it, ``load_best_model_at_end`` finds the best model, a resume ends
bit-for-bit where the uninterrupted run ended, rotation keeps the newest and the best, and a Hub push gets the
files upstream uploads.

Not tested, and why: the upload itself (``HfApi.upload_folder``); this machine cannot reach the Hub, and a
fake Hub would test the fake. The push test instead records the folder upstream's ``_push_from_checkpoint`` is
called with (through a subclass that records and returns, i.e. skips only the network part) and checks that
it holds every file upstream's push copies (``CONFIG_NAME``, ``SAFE_WEIGHTS_NAME``, ...) and, for
``hub_strategy="checkpoint"``, a committed ``asyncckpt/`` rather than its temporary directory.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import asyncckpt  # noqa: E402
from asyncckpt.errors import CheckpointError  # noqa: E402
from asyncckpt.integrations.huggingface import STATE_DIR, AsyncCkptTrainer  # noqa: E402

pytestmark = pytest.mark.timeout(180)

# What upstream's _save_checkpoint writes for this model with save_safetensors (the default), with the
# optimizer.pt/scheduler.pt/rng_state.pth it would add replaced by asyncckpt/.
CHECKPOINT_FILES = [
    "asyncckpt",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "trainer_state.json",
    "training_args.bin",
]


def _model() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _data(rows: int = 48) -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in tokens]


def _args(out: Path, max_steps: int = 6, **kwargs: Any) -> Any:
    return transformers.TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=3,
                                          per_device_train_batch_size=4, report_to=[], use_cpu=True, seed=0,
                                          logging_steps=100, disable_tqdm=True, **kwargs)  # fmt: skip


def _trainer(out: Path, max_steps: int = 6, cls: type = AsyncCkptTrainer, **kwargs: Any) -> AsyncCkptTrainer:
    return cls(model=_model(), args=_args(out, max_steps, **kwargs), train_dataset=_data(),
               asyncckpt_options={"codec": "zstd"})  # fmt: skip


def test_checkpoint_is_a_complete_hf_checkpoint_and_resumes_exactly(tmp_path: Path) -> None:
    straight = _trainer(tmp_path / "a")
    straight.train()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["checkpoint-3", "checkpoint-6"]
    checkpoint = tmp_path / "a" / "checkpoint-3"
    assert sorted(p.name for p in checkpoint.iterdir()) == CHECKPOINT_FILES
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 3
    asyncckpt.verify(checkpoint / STATE_DIR)
    saved = asyncckpt.load(checkpoint / STATE_DIR)
    assert set(saved) == {"optimizer", "scheduler", "rng"}  # the model is in model.safetensors, once
    assert saved["optimizer"]["state"][0]["exp_avg"].abs().sum() > 0

    # from_pretrained reads checkpoint-6 (tied lm_head included) as the model the run ended with.
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "a" / "checkpoint-6")
    for key, value in straight.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    resumed = _trainer(tmp_path / "b")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6
    assert resumed._asyncckpt_resumed is not None and resumed._asyncckpt_resumed["_path"] == str(checkpoint)
    for key, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), f"{key}: the resumed run diverged"

    latest = _trainer(tmp_path / "a", max_steps=6)
    latest.train(resume_from_checkpoint=True)  # get_last_checkpoint finds checkpoint-6
    assert latest._asyncckpt_resumed is not None
    assert latest._asyncckpt_resumed["_path"] == str(tmp_path / "a" / "checkpoint-6")
    for trainer in (straight, resumed, latest):
        trainer.close_checkpointer()


class _StagingBeforeFirstSave(transformers.TrainerCallback):
    """At step 2 (the first save is at step 3): the staging the checkpointer holds, once any
    preallocation has finished."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.staging_bytes: int | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2:
            if self.trainer.asyncckpt_preallocation is not None:
                self.trainer.asyncckpt_preallocation.join(60)
            checkpointer = self.trainer._asyncckpt
            self.staging_bytes = 0 if checkpointer is None else checkpointer._backend.stager.host_staging_bytes()


@pytest.mark.parametrize("preallocate", [True, False])
def test_staging_is_allocated_after_the_first_step_not_by_the_first_save(tmp_path: Path, preallocate: bool) -> None:
    probe = _StagingBeforeFirstSave()
    trainer = AsyncCkptTrainer(model=_model(), args=_args(tmp_path / "a", max_steps=3), train_dataset=_data(),
                               asyncckpt_options={"codec": "zstd"}, asyncckpt_preallocate=preallocate,
                               callbacks=[probe])  # fmt: skip
    probe.trainer = trainer
    trainer.train()
    trainer.checkpointer.wait()
    after_first_save = trainer.checkpointer._backend.stager.host_staging_bytes()
    assert after_first_save > 0  # the state's tensors too large to clone at save() go through the staging
    if preallocate:  # allocated before the first save, which then allocated nothing more
        assert trainer.asyncckpt_preallocation is not None and probe.staging_bytes == after_first_save
    else:  # the first save allocated it
        assert trainer.asyncckpt_preallocation is None and probe.staging_bytes == 0
    saved = asyncckpt.load(tmp_path / "a" / "checkpoint-3" / STATE_DIR)  # the save into that staging is whole
    for key, value in trainer.optimizer.state_dict()["state"][0].items():
        assert torch.equal(saved["optimizer"]["state"][0][key], value), key
    trainer.close_checkpointer()


def test_uncommitted_training_state_refuses_to_resume(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "a", max_steps=3)
    trainer.train()
    trainer.close_checkpointer()
    checkpoint = tmp_path / "a" / "checkpoint-3"
    # What a process killed mid-write leaves: the model files and a temporary directory, no committed asyncckpt/.
    (checkpoint / STATE_DIR).rename(checkpoint / ".tmp-step-0000000001-host-1-abcdef12")
    again = _trainer(tmp_path / "b", max_steps=6)
    with pytest.raises(CheckpointError, match="never committed"):
        again.train(resume_from_checkpoint=str(checkpoint))
    again.close_checkpointer()


class _FirstEvalBest:
    """compute_metrics whose first evaluation is the best one: the best checkpoint is not the last."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, _prediction: Any) -> dict[str, float]:
        self.calls += 1
        return {"score": 1.0 if self.calls == 1 else 0.0}


def test_load_best_model_at_end_and_rotation_keep_the_best(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = _FirstEvalBest()
    args = _args(tmp_path / "a", max_steps=9, eval_strategy="steps", eval_steps=3, load_best_model_at_end=True,
                 metric_for_best_model="score", greater_is_better=True, save_total_limit=2,
                 per_device_eval_batch_size=4)  # fmt: skip
    trainer = AsyncCkptTrainer(model=_model(), args=args, train_dataset=_data(), eval_dataset=_data(8),
                               compute_metrics=metrics, asyncckpt_options={"codec": "zstd"})  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer.train()
    trainer.close_checkpointer()
    assert metrics.calls == 3
    assert "Could not locate the best model" not in caplog.text
    assert trainer.state.best_model_checkpoint == str(tmp_path / "a" / "checkpoint-3")
    # save_total_limit=2 keeps the newest and the best, and deletes checkpoint-6 between them.
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["checkpoint-3", "checkpoint-9"]
    best = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "a" / "checkpoint-3").state_dict()
    last = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "a" / "checkpoint-9").state_dict()
    weight = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(best[weight], last[weight])
    for key, value in trainer.model.state_dict().items():  # the model in memory is the best one, not the last
        assert torch.equal(best[key], value), key


class _RecordingPush(AsyncCkptTrainer):
    """Records what upstream's push step is called with, and what the folder holds then; uploads nothing."""

    pushed: list[tuple[str, list[str], bool]]

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        folder = Path(checkpoint_folder)
        self.pushed.append((folder.name, sorted(p.name for p in folder.iterdir()),
                            asyncckpt.verify(folder / STATE_DIR).tensors > 0 if (folder / STATE_DIR).is_dir()
                            else False))  # fmt: skip


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint"])
def test_hub_push_gets_the_files_upstream_uploads(tmp_path: Path, strategy: str) -> None:
    from transformers.utils import CONFIG_NAME, GENERATION_CONFIG_NAME, SAFE_WEIGHTS_NAME

    trainer = _trainer(tmp_path / "a", cls=_RecordingPush, hub_strategy=strategy)
    trainer.pushed = []
    # Set after construction: Trainer.__init__ with push_to_hub=True creates the Hub repository (network).
    trainer.args.push_to_hub = True
    trainer.train()
    trainer.close_checkpointer()
    assert [name for name, _, _ in trainer.pushed] == ["checkpoint-3", "checkpoint-6"]
    for _name, files, committed in trainer.pushed:
        assert {CONFIG_NAME, GENERATION_CONFIG_NAME, SAFE_WEIGHTS_NAME} <= set(files)  # what upstream copies
        if strategy == "checkpoint":  # the whole folder is uploaded: its training state is committed first
            assert files == CHECKPOINT_FILES and committed


def test_checkpoints_of_the_earlier_layout_still_resume(tmp_path: Path) -> None:
    """Before the model files moved to upstream's layout, ``checkpoint-N/`` was one asyncckpt checkpoint
    holding the model, optimizer, scheduler and RNG states, with ``trainer_state.json`` beside its
    manifest. Such a checkpoint (written here as that code wrote it) resumes to the same end state."""
    from asyncckpt.integrations._targeted import TargetedCheckpointer

    straight = _trainer(tmp_path / "a")
    straight.train()
    new_layout = tmp_path / "a" / "checkpoint-3"
    state = {"model": transformers.GPT2LMHeadModel.from_pretrained(new_layout).state_dict(),
             **asyncckpt.load(new_layout / STATE_DIR)}  # fmt: skip
    old_layout = tmp_path / "old" / "checkpoint-3"
    with TargetedCheckpointer(tmp_path / "old", codec="zstd") as ckpt:
        ckpt.save_to(old_layout, state, files={"trainer_state.json": (new_layout / "trainer_state.json").read_bytes()})
    assert (old_layout / "manifest.json").is_file() and not (old_layout / "model.safetensors").exists()

    resumed = _trainer(tmp_path / "b")
    resumed.train(resume_from_checkpoint=str(old_layout))
    assert resumed.state.global_step == 6
    for key, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), f"{key}: the resumed run diverged"
    for trainer in (straight, resumed):
        trainer.close_checkpointer()
