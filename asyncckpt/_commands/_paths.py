"""Path arguments of the commands: one clear error for a missing path or a file where a directory belongs.

:class:`~asyncckpt.errors.CheckpointError` here becomes exit status 2 with one line on stderr
(:mod:`asyncckpt.cli`). Calling thread.
"""

from __future__ import annotations

from pathlib import Path

from .._manifest import MANIFEST_NAME, read_manifest
from .._resolve import resolve_for_reading
from ..errors import CheckpointError


def existing_directory(path: str, what: str) -> Path:
    """``path`` as a directory; raises CheckpointError saying what is there instead."""
    target = Path(path)
    if not target.exists():
        raise CheckpointError(f"{path}: no such {what}")
    if not target.is_dir():
        raise CheckpointError(f"{path}: is a file, not a {what} (a checkpoint is a directory holding {MANIFEST_NAME})")
    return target


def checkpoint_path(path: str, step: int | None) -> Path:
    """The checkpoint ``path`` names: itself, or its latest (or ``step``) when it is a run directory.

    Resolved as ``load`` resolves it (:mod:`asyncckpt._resolve`): a ``latest`` naming a missing
    checkpoint, or a symlinked step, is an error, never a silent older checkpoint."""
    existing_directory(path, "checkpoint or run directory")
    return resolve_for_reading(path, "latest" if step is None else step).path


def stored_bytes(path: str, step: int | None) -> int:
    """The stored size of the checkpoint ``path`` names, for a progress bar; 0 if its manifest cannot be read.

    Best effort on purpose: the command's own read reports a corrupt manifest properly.
    """
    try:
        return read_manifest(checkpoint_path(path, step)).stored_bytes
    except (CheckpointError, OSError):
        return 0
