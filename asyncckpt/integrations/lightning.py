"""A Lightning ``CheckpointIO`` plugin: Lightning checkpoints saved asynchronously by asyncckpt.

::

    import lightning as L
    from asyncckpt.integrations.lightning import AsyncCkptIO

    trainer = L.Trainer(plugins=[AsyncCkptIO(codec="zstd")], ...)
    trainer.fit(model)                                   # checkpoints: snapshot, then written in the background
    L.Trainer(plugins=[AsyncCkptIO()]).fit(model, ckpt_path=".../last.ckpt")    # resume

Each checkpoint path Lightning chooses (``epoch=0-step=10.ckpt``, ``last.ckpt``) becomes an
asyncckpt checkpoint *directory* of that name (``manifest.json`` + data file), committed
atomically; a re-save of ``last.ckpt`` replaces the old one whole. ``save_checkpoint`` returns
once the snapshot is taken (the same guarantee as :class:`~asyncckpt.AsyncCheckpointer`: training
may go on mutating the weights), unlike Lightning's own ``AsyncCheckpointIO``, which hands the live
tensors to a thread and can write a torn checkpoint. A failed background save is raised by the
next ``save_checkpoint`` or at ``teardown`` (end of ``fit``), never swallowed; ``load_checkpoint``
and ``remove_checkpoint`` first wait for a save to the same path still in flight.

Lightning puts objects in a checkpoint that asyncckpt does not pickle: dict subclasses such as
``AttributeDict`` hyper-parameters are stored as plain dicts; anything else unsupported raises a
``TypeError`` naming its key (drop it, or convert it in ``on_save_checkpoint``).

Loading: ``load_checkpoint`` puts every tensor on the CPU unless given a ``map_location`` device,
as Lightning's ``TorchCheckpointIO`` does (Lightning passes none; ``load_state_dict`` then copies
into the model's device), so a checkpoint saved on a GPU resumes on a CPU-only machine.
``LightningModule.load_from_checkpoint(path)`` reads ``path`` with ``torch.load`` itself, never
through a ``CheckpointIO`` plugin, and fails on these directories (``IsADirectoryError``); call
:func:`load_from_checkpoint` (``load_from_checkpoint(MyModel, path)``) instead, or add
:class:`AsyncCkptLoadable` to the module's bases so ``MyModel.load_from_checkpoint(path)`` reads both
kinds. Both hand Lightning's own ``load_from_checkpoint`` the checkpoint as a ``torch.save``
stream, so hyper-parameters, ``strict``, ``map_location`` and ``on_load_checkpoint`` behave as
upstream.

Staging ahead of the first save: add :class:`AsyncCkptPreallocate` to the trainer's callbacks
(``L.Trainer(plugins=[AsyncCkptIO()], callbacks=[AsyncCkptPreallocate(), ...])``). At the end of the
first optimizer step it has the plugin allocate the staging a save of the model and optimizer state
needs (pinned host memory, or GPU memory for a device copy), in the background, so the first save
does not pin tens of GB while training waits. A ``CheckpointIO`` sees no training step, hence the
callback.

Threads: every method runs on the training thread (Lightning calls them on global rank 0 only).
"""

from __future__ import annotations

import io
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

from .._loader import load
from .._manifest import MANIFEST_NAME
from ._targeted import TargetedCheckpointer, preallocate_or_warn, remove_checkpoint_dir

__all__ = ["AsyncCkptIO", "AsyncCkptLoadable", "AsyncCkptPreallocate", "load_from_checkpoint"]

ModuleT = TypeVar("ModuleT")


class AsyncCkptIO(CheckpointIO):
    """Asynchronous, compressed, checksummed Lightning checkpoints.

    Args:
        **options: :class:`~asyncckpt.CheckpointOptions` fields (``codec``, ``max_inflight``,
            ``when_busy``, ``snapshot``, ``metrics_port``, ...), plus ``observer``/``registry``
            as for :class:`~asyncckpt.AsyncCheckpointer`.
    """

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._checkpointer: TargetedCheckpointer | None = None
        self._preallocation: threading.Thread | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:  # fmt: skip
        if storage_options is not None:
            raise TypeError(f"AsyncCkptIO.save_checkpoint takes no storage_options, got {storage_options!r}")
        target = Path(path)
        step = checkpoint.get("global_step")
        metadata = {"lightning": {"global_step": step if isinstance(step, int) else None, "path": str(target)}}
        self._checkpointer_in(target.parent).save_to(target, _plain(checkpoint), metadata=metadata)

    def preallocate(self, state: dict[str, Any], directory: str | os.PathLike[str]) -> threading.Thread:
        """Allocate the staging a save of ``state`` (the tensors every checkpoint holds: the model's and
        the optimizers' states) will need, on a background thread, which is returned started; the
        checkpoints go to ``directory``. :class:`AsyncCkptPreallocate` calls it after the first step."""
        self._preallocation = self._checkpointer_in(Path(directory)).preallocate(_plain(state))
        return self._preallocation

    def _checkpointer_in(self, directory: Path) -> TargetedCheckpointer:
        """The checkpointer, built on first use (a save, or a preallocation): only then is the directory known."""
        if self._checkpointer is None:
            self._checkpointer = TargetedCheckpointer(directory, **self._options)
        return self._checkpointer

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:  # fmt: skip
        """Load a checkpoint this plugin wrote. Never unpickles anything, so ``weights_only`` is moot.

        ``map_location``: a device (``"cpu"``, ``"cuda:0"``) for every tensor; None, or Lightning's
        default callable, loads to the CPU as ``TorchCheckpointIO`` does. Other callables and dicts
        cannot be honoured without pickle's storage hooks and are refused.
        """
        if self._checkpointer is not None:
            self._checkpointer.wait_for(path)
        state = load(path, map_location=_device(map_location))
        if not isinstance(state, dict):
            raise TypeError(f"{path}: holds a {type(state).__name__}, not a Lightning checkpoint dict")
        return state

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        if self._checkpointer is not None:
            self._checkpointer.wait_for(path)
        remove_checkpoint_dir(path)

    def teardown(self) -> None:
        """Finish every in-flight save (end of ``fit``); raises a background failure once."""
        checkpointer, self._checkpointer = self._checkpointer, None
        preallocation, self._preallocation = self._preallocation, None
        if preallocation is not None:
            preallocation.join()  # a fit that ends within its first steps: never free staging still being allocated
        if checkpointer is not None:
            checkpointer.close()


class AsyncCkptPreallocate(Callback):
    """Has :class:`AsyncCkptIO` allocate its staging at the end of the first optimizer step of ``fit``.

    The step creates the optimizer's moments, and every checkpoint takes the same tensors, so the
    staging sized then is what each save copies or fences into. On the process that saves (global
    rank 0), when the trainer's checkpoint plugin is an :class:`AsyncCkptIO`, its ``ModelCheckpoint``
    has a directory and the state is replicated (one device, or DDP: FSDP and DeepSpeed shard it and
    bypass ``CheckpointIO``); otherwise it does nothing. A state that cannot be
    preallocated is a warning, and the first save allocates (and reports what is wrong) as it
    would without the callback; so is a checkpoint that holds more than those states (an EMA copy
    of the weights): its first save grows the staging. ``thread`` is the allocation (None until it
    started). Training thread; the allocation runs on its own, and the plugin's ``teardown`` waits
    for it.
    """

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self._done = False

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._done = False  # the plugin's teardown closed the last fit's checkpointer and its staging

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._done or trainer.global_step < 1:  # global_step counts optimizer steps (after accumulation)
            return
        self._done = True
        strategy, directory = trainer.strategy, getattr(trainer.checkpoint_callback, "dirpath", None)
        if not isinstance(strategy.checkpoint_io, AsyncCkptIO) or not trainer.is_global_zero or directory is None:
            return
        if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or isinstance(strategy, DeepSpeedStrategy):
            return  # sharded state: gathering it is a collective, which this rank alone would wait on forever
        # What Lightning's dump_checkpoint puts in every checkpoint, in its order, without calling the
        # hooks that dump runs (on_save_checkpoint): those belong to the saves. The optimizers' own
        # state_dict(): the strategy's optimizer_state() may consolidate a sharded optimizer (a collective).
        state = {"state_dict": pl_module.state_dict(), "optimizer_states": [o.state_dict() for o in trainer.optimizers]}
        plugin = strategy.checkpoint_io
        self.thread = preallocate_or_warn(lambda: plugin.preallocate(state, directory))


def _device(map_location: Any) -> str | torch.device:
    if map_location is None:
        return "cpu"
    if isinstance(map_location, (str, torch.device)):
        return map_location
    if callable(map_location) and _keeps_on_cpu(map_location):
        return "cpu"  # TorchCheckpointIO's default `lambda storage, loc: storage` keeps storages on the CPU
    raise TypeError(f"AsyncCkptIO.load_checkpoint: map_location must be a device ('cpu', 'cuda:0') or None (the "
                    f"CPU, as TorchCheckpointIO), got {map_location!r}")  # fmt: skip


def _keeps_on_cpu(map_location: Any) -> bool:
    """Whether a torch.load storage hook leaves a CPU storage on the CPU (probed with an empty one)."""
    try:
        return bool(map_location(torch.empty(0).untyped_storage(), "cpu").device.type == "cpu")
    except (RuntimeError, TypeError, AttributeError, ValueError):  # e.g. `.cuda()` on a machine without CUDA
        return False


def is_asyncckpt_checkpoint(path: Any) -> bool:
    """True when ``path`` is a checkpoint directory written by :class:`AsyncCkptIO`."""
    return isinstance(path, (str, os.PathLike)) and (Path(path) / MANIFEST_NAME).is_file()


def load_from_checkpoint(cls: type[ModuleT], checkpoint_path: str | os.PathLike[str], **kwargs: Any) -> ModuleT:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` for a checkpoint directory :class:`AsyncCkptIO` wrote.

    Reads and verifies it on the CPU, then hands Lightning's own ``load_from_checkpoint`` the state
    as an in-memory ``torch.save`` stream (Lightning reads streams with ``torch.load``, no plugin), so
    ``map_location``, ``strict``, ``hparams_file`` and the hyper-parameter overrides in ``kwargs`` act as
    upstream. Holds the state twice in host memory meanwhile. Calling thread.
    """
    if not is_asyncckpt_checkpoint(checkpoint_path):
        upstream = f"{cls.__name__}.load_from_checkpoint"
        raise FileNotFoundError(f"{checkpoint_path}: not a checkpoint directory written by AsyncCkptIO (no "
                                f"{MANIFEST_NAME}); for a torch.save file, call {upstream}")  # fmt: skip
    stream = io.BytesIO()
    torch.save(load(checkpoint_path, map_location="cpu"), stream)
    stream.seek(0)
    # A stream: Lightning's own loader (AsyncCkptLoadable passes streams through to it too).
    module: ModuleT = cls.load_from_checkpoint(stream, **kwargs)  # type: ignore[attr-defined]
    return module


class AsyncCkptLoadable:
    """LightningModule mixin: ``MyModel.load_from_checkpoint(path)`` also reads :class:`AsyncCkptIO` directories.

    ``class MyModel(AsyncCkptLoadable, L.LightningModule)``; a ``torch.save`` file or stream is read by
    Lightning as before.
    """

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if args or not is_asyncckpt_checkpoint(checkpoint_path):
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
        return load_from_checkpoint(cls, checkpoint_path, **kwargs)


def _plain(value: Any) -> Any:
    """Dict subclasses other than OrderedDict (Lightning's AttributeDict) as plain dicts; the rest unchanged."""
    if isinstance(value, dict):
        kind = OrderedDict if type(value) is OrderedDict else dict
        return kind((k, _plain(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value
