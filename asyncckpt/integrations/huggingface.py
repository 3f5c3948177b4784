"""A Hugging Face ``Trainer`` whose checkpoints are saved asynchronously by asyncckpt.

::

    from asyncckpt.integrations.huggingface import AsyncCkptTrainer

    trainer = AsyncCkptTrainer(model=model, args=args, train_dataset=data, asyncckpt_options={"codec": "zstd"})
    trainer.train()                                  # checkpoint-N/ written in the background
    trainer.train(resume_from_checkpoint=True)       # resumes from the latest checkpoint-N/

Why a subclass and not a callback: ``TrainerCallback.on_save`` runs *after* the Trainer has
already written everything synchronously (``save_pretrained``, ``torch.save`` of the optimizer,
scheduler and RNG states); a callback can neither skip nor replace that. So this class overrides
the Trainer's checkpoint methods — ``_save_checkpoint``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_rng_state`` — which are private API: the trade-off is
that a new ``transformers`` release may rename them (this is tested with transformers 5.x), in
exchange for taking the whole save off the training loop. Use :class:`AsyncCkptTrainerMixin` to add
it to another Trainer subclass (``class MyTrainer(AsyncCkptTrainerMixin, SFTTrainer)``).

What ``checkpoint-N/`` holds: one asyncckpt checkpoint (``manifest.json`` + data file) with the
model's state dict, the optimizer, scheduler, gradient scaler and RNG states, plus
``trainer_state.json`` — all committed atomically, after the snapshot is taken and training has
moved on. ``resume_from_checkpoint`` accepts these and ordinary Trainer checkpoints alike.
``trainer.save_model()`` (the final export for ``from_pretrained``/the Hub) is unchanged and
synchronous. Rotation (``save_total_limit``) counts only committed checkpoints, so up to
``max_inflight`` more may exist for a moment. With several processes (DDP) the main process saves
the (replicated) state; other processes' RNG states are not saved.

Threads: everything here runs on the training thread; writing runs on asyncckpt's worker thread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..loader import load
from ..manifest import MANIFEST_NAME
from ._targeted import TargetedCheckpointer

__all__ = ["AsyncCkptTrainer", "AsyncCkptTrainerMixin"]


def is_asyncckpt_checkpoint(path: str | os.PathLike[str] | None) -> bool:
    return path is not None and (Path(path) / MANIFEST_NAME).is_file()


class AsyncCkptTrainerMixin:
    """Trainer mixin: checkpoints through asyncckpt (see the module docstring).

    Args:
        asyncckpt_options: :class:`~asyncckpt.CheckpointOptions` fields (``codec``, ``max_inflight``,
            ``metrics_port``, ...) plus ``observer``/``registry``.
    """

    def __init__(self, *args: Any, asyncckpt_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._asyncckpt_options = dict(asyncckpt_options or {})
        self._asyncckpt: TargetedCheckpointer | None = None
        self._asyncckpt_resumed: dict[str, Any] | None = None

    @property
    def checkpointer(self) -> TargetedCheckpointer:
        if self._asyncckpt is None:
            output_dir = self.args.output_dir  # type: ignore[attr-defined]  # the Trainer's
            self._asyncckpt = TargetedCheckpointer(output_dir, **self._asyncckpt_options)
        return self._asyncckpt

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, then wait for the checkpoints still being written (raises a failed one)."""
        output = super().train(*args, **kwargs)  # type: ignore[misc]
        if self._asyncckpt is not None:
            self._asyncckpt.wait()
        return output

    def close_checkpointer(self) -> None:
        """Finish in-flight saves and stop the worker thread (also happens at interpreter exit)."""
        checkpointer, self._asyncckpt = self._asyncckpt, None
        if checkpointer is not None:
            checkpointer.close()

    # -- saving -------------------------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        trainer: Any = self
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        run_dir = trainer._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
        if trainer.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.best_global_step}")
            if os.path.exists(best) or best == output_dir:
                trainer.state.best_model_checkpoint = best
        for callback in [*trainer.callback_handler.callbacks, trainer.control]:
            if isinstance(callback, ExportableState):  # as Trainer._save_checkpoint does
                name = type(callback).__name__
                if isinstance(trainer.state.stateful_callbacks[name], list):
                    trainer.state.stateful_callbacks[name].append(callback.state())
                else:
                    trainer.state.stateful_callbacks[name] = callback.state()
        if not trainer.args.should_save:
            return
        state: dict[str, Any] = {"model": trainer.accelerator.unwrap_model(model).state_dict()}
        if not trainer.args.save_only_model:
            state["optimizer"] = trainer.optimizer.state_dict()
            if trainer.lr_scheduler is not None:
                state["scheduler"] = trainer.lr_scheduler.state_dict()
            scaler = getattr(trainer.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler.state_dict()
            state["rng"] = _rng_state()
        # The same JSON TrainerState.save_to_json writes, taken now (at the snapshot), committed with the tensors.
        trainer_state = (json.dumps(dataclasses.asdict(trainer.state), indent=2, sort_keys=True) + "\n").encode()
        self.checkpointer.save_to(output_dir, state, files={TRAINER_STATE_NAME: trainer_state},
                                  metadata={"huggingface": {"global_step": trainer.state.global_step}})  # fmt: skip
        rotate_checkpoints(output_dir=run_dir, save_total_limit=trainer.args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)  # fmt: skip

    # -- resuming -----------------------------------------------------------------------------------
    def _resumed(self, checkpoint: str) -> dict[str, Any]:
        if self._asyncckpt is not None:
            self._asyncckpt.wait_for(checkpoint)
        if self._asyncckpt_resumed is None or self._asyncckpt_resumed.get("_path") != str(checkpoint):
            state = load(checkpoint, map_location="cpu")
            if not isinstance(state, dict) or "model" not in state:
                raise TypeError(f"{checkpoint}: not a checkpoint written by AsyncCkptTrainer")
            self._asyncckpt_resumed = {**state, "_path": str(checkpoint)}
        return self._asyncckpt_resumed

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        if not is_asyncckpt_checkpoint(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        target = model if model is not None else self.model  # type: ignore[attr-defined]
        target.load_state_dict(self._resumed(resume_from_checkpoint)["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not is_asyncckpt_checkpoint(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        assert checkpoint is not None
        state = self._resumed(checkpoint)
        trainer: Any = self
        if "optimizer" in state:
            trainer.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state and trainer.lr_scheduler is not None:
            trainer.lr_scheduler.load_state_dict(state["scheduler"])
        scaler = getattr(trainer.accelerator, "scaler", None)
        if "scaler" in state and scaler is not None:
            scaler.load_state_dict(state["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not is_asyncckpt_checkpoint(checkpoint):
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        assert checkpoint is not None
        rng = self._resumed(checkpoint).get("rng")
        if rng is not None:
            _set_rng_state(rng)


class AsyncCkptTrainer(AsyncCkptTrainerMixin, Trainer):
    """``transformers.Trainer`` with asynchronous asyncckpt checkpoints (see the module docstring)."""


def _rng_state() -> dict[str, Any]:
    """Python, NumPy, CPU and CUDA generator states in types asyncckpt stores (no pickle)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(np.array(keys, dtype=np.uint32)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "cpu": torch.random.get_rng_state(),
    }  # fmt: skip
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy(), numpy["pos"], numpy["has_gauss"],
                         numpy["cached_gaussian"]))  # fmt: skip
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])
