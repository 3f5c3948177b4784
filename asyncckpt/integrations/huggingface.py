"""A Hugging Face ``Trainer`` whose optimizer, scheduler and RNG states are saved asynchronously by asyncckpt.

::

    from asyncckpt.integrations.huggingface import AsyncCkptTrainer

    trainer = AsyncCkptTrainer(model=model, args=args, train_dataset=data, asyncckpt_options={"codec": "zstd"})
    trainer.train()                                  # checkpoint-N/ written, its training state in the background
    trainer.train(resume_from_checkpoint=True)       # resumes from the latest checkpoint-N/
    AutoModelForCausalLM.from_pretrained("out/checkpoint-N")                  # as with any Trainer checkpoint

What ``checkpoint-N/`` holds: what upstream's ``Trainer._save_checkpoint`` writes, with one
asyncckpt checkpoint in place of ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` and
``rng_state.pth``:

* the model, written by upstream's ``Trainer.save_model`` (``config.json``, ``model.safetensors``
  or its shards, ``generation_config.json``, the processing class' files), synchronously on the
  training thread as upstream does: ``from_pretrained``, ``load_best_model_at_end`` and Hub
  pushes read exactly these files;
* ``trainer_state.json``, written by upstream's ``TrainerState.save_to_json``;
* ``asyncckpt/`` (:data:`STATE_DIR`): ``manifest.json`` + data file holding the optimizer,
  scheduler, gradient scaler and RNG states, snapshotted before ``_save_checkpoint`` returns and
  committed atomically by asyncckpt's worker thread while training goes on. A checkpoint whose
  ``asyncckpt/`` was never committed (the process died first) refuses to resume, naming it.

The trade-off: the model weights (a third of an AdamW state in FP32) are written synchronously,
as upstream writes them, because ``from_pretrained`` and the Hub need them as safetensors; the
rest of the state (two thirds) is taken off the training loop.

Why a subclass and not a callback: ``TrainerCallback.on_save`` runs *after* the Trainer has
already written everything synchronously; a callback can neither skip nor replace that. So this
class overrides the Trainer's private ``_save_checkpoint``, ``_load_optimizer_and_scheduler``,
``_load_rng_state`` and ``_load_best_model``; a new ``transformers`` release may rename them. The
floor is transformers 4.50 (the first with ``TrainerState.best_global_step``, which
``_save_checkpoint`` follows as upstream does); the tests ran under 4.50.0 and the newest release
(``docs/distributed.md`` says how). Use :class:`AsyncCkptTrainerMixin` to add it to another
Trainer subclass (``class MyTrainer(AsyncCkptTrainerMixin, SFTTrainer)``).

Hub pushes (``push_to_hub=True``) call upstream's ``_push_from_checkpoint``: with
``hub_strategy`` ``"every_save"``/``"end"`` right away (it uploads only the model files, already
written), with ``"checkpoint"``/``"all_checkpoints"`` (which upload the whole folder) only after
``asyncckpt/`` is committed, so that save waits for its training state to be durable.
Rotation (``save_total_limit``) waits for a save still in flight to a checkpoint it deletes. With
several processes (DDP) the main process saves the (replicated) state; other processes' RNG
states are not saved.

Staging memory: after the first optimizer step of ``train()`` (which creates the optimizer's
moments) the trainer calls :meth:`~asyncckpt.AsyncCheckpointer.preallocate` for the training
state, so the host (pinned) or GPU staging the saves need is allocated in the background long
before the first save, instead of during it: pinning tens of GB takes seconds, which a first save
spends on the training thread (``host`` mode) or while the next optimizer step waits (``fence``).
The cost is that staging is held from the first step rather than from the first save.
``asyncckpt_preallocate=False`` turns it off.

Threads: everything here runs on the training thread; asyncckpt's worker thread writes ``asyncckpt/``,
and a background thread of asyncckpt's allocates the staging.
"""

from __future__ import annotations

import os
import random
import re
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .._loader import load
from .._manifest import MANIFEST_NAME
from ..errors import CheckpointError
from ._targeted import TargetedCheckpointer, preallocate_or_warn, remove_checkpoint_dir

__all__ = ["STATE_DIR", "AsyncCkptTrainer", "AsyncCkptTrainerMixin", "is_asyncckpt_checkpoint"]

STATE_DIR = "asyncckpt"
"""The subdirectory of ``checkpoint-N/`` holding the asyncckpt checkpoint of the training state."""

_HUB_FOLDER_STRATEGIES = ("checkpoint", "all_checkpoints")  # upload the checkpoint folder itself


def is_asyncckpt_checkpoint(path: str | os.PathLike[str] | None) -> bool:
    """True when ``path`` is a ``checkpoint-N/`` whose asyncckpt training state is committed."""
    return _state_dir(path) is not None


def _state_dir(path: str | os.PathLike[str] | None) -> Path | None:
    """Where ``checkpoint-N/`` keeps its asyncckpt training state: ``asyncckpt/``; or, for checkpoints
    written before the model files moved to upstream's layout, ``checkpoint-N/`` itself (a manifest
    at its root holding the model too). None when there is none."""
    if path is None:
        return None
    if (Path(path) / STATE_DIR / MANIFEST_NAME).is_file():
        return Path(path) / STATE_DIR
    if (Path(path) / MANIFEST_NAME).is_file():
        return Path(path)
    return None


def _uncommitted(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds an asyncckpt save that never committed (its temporary directory)."""
    return any(p.name.startswith(".tmp-") for p in Path(path).iterdir()) if Path(path).is_dir() else False


class AsyncCkptTrainerMixin:
    """Trainer mixin: the training state through asyncckpt (see the module docstring).

    Args:
        asyncckpt_options: :class:`~asyncckpt.CheckpointOptions` fields (``codec``, ``max_inflight``,
            ``metrics_port``, ...) plus ``observer``/``registry``.
        asyncckpt_preallocate: allocate the saves' staging memory in the background after the first
            optimizer step (default), rather than in the first save (module docstring).
    """

    def __init__(self, *args: Any, asyncckpt_options: dict[str, Any] | None = None,
                 asyncckpt_preallocate: bool = True, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self._asyncckpt_options = dict(asyncckpt_options or {})
        self._asyncckpt: TargetedCheckpointer | None = None
        self._asyncckpt_resumed: dict[str, Any] | None = None
        self.asyncckpt_preallocation: threading.Thread | None = None
        """The background allocation of the staging, once started after the first optimizer step."""
        if asyncckpt_preallocate:
            self.add_callback(_PreallocateAfterFirstStep(self))  # type: ignore[attr-defined]  # the Trainer's

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

    # -- saving: upstream's Trainer._save_checkpoint, step for step, with the training state in asyncckpt/ ------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        trainer: Any = self
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        run_dir = trainer._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
        trainer.save_model(output_dir, _internal_call=True)
        if trainer.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.best_global_step}")
            if os.path.exists(best):
                trainer.state.best_model_checkpoint = best
        handle = None
        if trainer.args.should_save and not trainer.args.save_only_model:
            state = self._training_state()
            # Under a name asyncckpt commits atomically; a re-save of the same step replaces it whole.
            metadata = {"huggingface": {"global_step": trainer.state.global_step}}
            handle = self.checkpointer.save_to(os.path.join(output_dir, STATE_DIR), state, metadata=metadata)
        if trainer.args.should_save:
            for callback in [*trainer.callback_handler.callbacks, trainer.control]:
                if isinstance(callback, ExportableState):  # as Trainer._save_checkpoint does
                    name = type(callback).__name__
                    if isinstance(trainer.state.stateful_callbacks[name], list):
                        trainer.state.stateful_callbacks[name].append(callback.state())
                    else:
                        trainer.state.stateful_callbacks[name] = callback.state()
            trainer.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
        if trainer.args.push_to_hub:
            strategy = getattr(trainer.args.hub_strategy, "value", trainer.args.hub_strategy)
            if handle is not None and strategy in _HUB_FOLDER_STRATEGIES:
                handle.result()  # the folder upload must see a committed asyncckpt/, not its temporary
            trainer._push_from_checkpoint(output_dir)
        if trainer.args.should_save:
            self._rotate(run_dir)

    def _preallocate_staging(self) -> None:
        """Start allocating the staging for the training state, where this process saves it. Training thread."""
        trainer: Any = self
        strategy = getattr(trainer.args.save_strategy, "value", trainer.args.save_strategy)
        if not trainer.args.should_save or trainer.args.save_only_model or strategy == "no":
            return

        def start() -> threading.Thread:  # the state too is taken within the warning's reach, as before
            return self.checkpointer.preallocate(self._training_state())

        self.asyncckpt_preallocation = preallocate_or_warn(start)

    def _training_state(self) -> dict[str, Any]:
        """Optimizer, scheduler, scaler and RNG states: upstream's optimizer.pt/scheduler.pt/scaler.pt/rng_state.pth."""
        trainer: Any = self
        state: dict[str, Any] = {"optimizer": trainer.optimizer.state_dict()}
        if trainer.lr_scheduler is not None:
            state["scheduler"] = trainer.lr_scheduler.state_dict()
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        state["rng"] = _rng_state()
        return state

    def _rotate(self, run_dir: str) -> None:
        """Keep ``save_total_limit`` checkpoints: the newest and the best always (as upstream's rotation)."""
        trainer: Any = self
        limit = trainer.args.save_total_limit
        if limit is None or limit <= 0:
            return
        pattern = re.compile(rf"^{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)$")
        found = [(int(m.group(1)), p) for p in Path(run_dir).iterdir() if (m := pattern.match(p.name)) and p.is_dir()]
        checkpoints = [p for _, p in sorted(found)]
        protected = set(checkpoints[-1:])
        if trainer.state.best_model_checkpoint is not None:
            protected.add(Path(trainer.state.best_model_checkpoint))
        excess = len(checkpoints) - max(limit, len(protected))
        for path in checkpoints:
            if excess <= 0:
                break
            if path in protected:
                continue
            if self._asyncckpt is not None:
                self._asyncckpt.wait_for(path / STATE_DIR)  # never delete under a save still in flight
            remove_checkpoint_dir(path)
            excess -= 1

    def _load_best_model(self) -> None:
        # Upstream deletes every checkpoint but the best right after this (save_total_limit=1): finish writing first.
        if self._asyncckpt is not None:
            self._asyncckpt.wait()
        super()._load_best_model()  # type: ignore[misc]

    # -- resuming: the model comes from upstream's files (upstream _load_from_checkpoint), the rest from asyncckpt/
    def _resumed(self, checkpoint: str) -> dict[str, Any]:
        if self._asyncckpt_resumed is None or self._asyncckpt_resumed.get("_path") != str(checkpoint):
            where = _state_dir(checkpoint)
            state = load(where, map_location="cpu") if where is not None else None
            if not isinstance(state, dict) or not ({"optimizer", "model"} & set(state)):
                raise CheckpointError(f"{checkpoint}: not a training state written by AsyncCkptTrainer")
            self._asyncckpt_resumed = {**state, "_path": str(checkpoint)}
        return self._asyncckpt_resumed

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        # The model comes from upstream's files, except in checkpoints of the earlier layout,
        # which hold it in the asyncckpt state at their root.
        if _state_dir(resume_from_checkpoint) != Path(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        target = model if model is not None else self.model  # type: ignore[attr-defined]
        target.load_state_dict(self._resumed(resume_from_checkpoint)["model"])

    def _committed(self, checkpoint: str | None) -> bool:
        """Whether ``checkpoint`` has an asyncckpt training state; raises if its save never committed."""
        if checkpoint is None:
            return False
        if self._asyncckpt is not None:
            self._asyncckpt.wait_for(Path(checkpoint) / STATE_DIR)
        if is_asyncckpt_checkpoint(checkpoint):
            return True
        if _uncommitted(checkpoint):
            raise CheckpointError(
                f"{checkpoint}: its optimizer/scheduler/RNG state (asyncckpt/) was never committed (the process "
                "stopped while it was being written); resume from the checkpoint before it, or delete this one"
            )
        return False

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._committed(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        assert checkpoint is not None
        state = self._resumed(checkpoint)
        trainer: Any = self
        if "optimizer" in state:  # absent only in an earlier-layout save_only_model checkpoint
            trainer.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state and trainer.lr_scheduler is not None:
            trainer.lr_scheduler.load_state_dict(state["scheduler"])
        scaler = getattr(trainer.accelerator, "scaler", None)
        if "scaler" in state and scaler is not None:
            scaler.load_state_dict(state["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._committed(checkpoint):
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        assert checkpoint is not None
        rng = self._resumed(checkpoint).get("rng")
        if rng is not None:
            _set_rng_state(rng)


class _PreallocateAfterFirstStep(TrainerCallback):
    """Calls the trainer's ``_preallocate_staging`` once, at the end of the first optimizer step of a run
    (the moments exist from then on, and every save takes the same tensors). Training thread."""

    def __init__(self, trainer: AsyncCkptTrainerMixin) -> None:
        self._trainer = weakref.ref(trainer)  # the trainer holds this callback: no cycle through it
        self._done = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if self._done or trainer is None:
            return
        self._done = True
        trainer._preallocate_staging()


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
