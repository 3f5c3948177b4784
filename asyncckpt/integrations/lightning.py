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

Threads: every method runs on the training thread (Lightning calls them on global rank 0 only).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from ..loader import load
from ._targeted import TargetedCheckpointer, remove_checkpoint_dir

__all__ = ["AsyncCkptIO"]


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

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:  # fmt: skip
        if storage_options is not None:
            raise TypeError(f"AsyncCkptIO.save_checkpoint takes no storage_options, got {storage_options!r}")
        target = Path(path)
        if self._checkpointer is None:  # built at the first save: only then is the directory known
            self._checkpointer = TargetedCheckpointer(target.parent, **self._options)
        step = checkpoint.get("global_step")
        metadata = {"lightning": {"global_step": step if isinstance(step, int) else None, "path": str(target)}}
        self._checkpointer.save_to(target, _plain(checkpoint), metadata=metadata)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:  # fmt: skip
        """Load a checkpoint this plugin wrote. Never unpickles anything, so ``weights_only`` is moot."""
        if self._checkpointer is not None:
            self._checkpointer.wait_for(path)
        location = map_location if isinstance(map_location, (str, torch.device)) else None
        state = load(path, map_location=location)
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
        if checkpointer is not None:
            checkpointer.close()


def _plain(value: Any) -> Any:
    """Dict subclasses other than OrderedDict (Lightning's AttributeDict) as plain dicts; the rest unchanged."""
    if isinstance(value, dict):
        kind = OrderedDict if type(value) is OrderedDict else dict
        return kind((k, _plain(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value
