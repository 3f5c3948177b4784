"""Which checkpoint directory a reader opens: strict about the ``latest`` pointer and symlinks.

:func:`asyncckpt._layout.resolve_checkpoint` answers the question for listing tools; the loader
asks it here with two refusals on top, because a reader that silently opens something else
returns the wrong state:

* ``latest`` that names a step whose checkpoint is missing (its directory or its manifest gone)
  raises, naming that step and the newest committed one, instead of falling back to an older
  state. A missing or unreadable pointer still falls back to the highest committed step: a
  commit whose pointer update failed removes the pointer on purpose (docs/format.md).
* a ``step-*`` entry of a run directory that is a symlink is refused: it may point outside the
  run, and :func:`asyncckpt._layout.list_checkpoints` does not count it as a checkpoint either.

A checkpoint directory given directly (it holds ``manifest.json``) is read as given. Runs on
the calling thread.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ._layout import LATEST_NAME, checkpoint_name, latest_pointer, list_checkpoints, resolve_checkpoint
from ._manifest import MANIFEST_NAME
from .errors import CheckpointError

_STEP_NAME = re.compile(r"step-(\d{10,20})")


@dataclass(frozen=True)
class Resolved:
    """A checkpoint directory to read, and how it was reached."""

    path: Path
    via_latest: bool = False
    """Reached through the run directory's ``latest`` pointer."""

    def context(self) -> str:
        """What to add to an error about this checkpoint so that it names the fallback too."""
        if not self.via_latest:
            return ""
        others = [c.step for c in list_checkpoints(self.path.parent) if c.path.name != self.path.name]
        hint = f"; the newest other committed step is {others[-1]}: load(..., step={others[-1]})" if others else ""
        return f" ({self.path.parent / LATEST_NAME} names this checkpoint; not falling back to an older one{hint})"


def resolve_for_reading(directory_or_checkpoint: str | os.PathLike[str], step: int | str = "latest") -> Resolved:
    """The checkpoint to read for ``load``/``verify``; raises CheckpointError naming what is wrong."""
    root = Path(directory_or_checkpoint)
    if (root / MANIFEST_NAME).is_file():
        return Resolved(root)
    if type(step) is int and step >= 0:
        _refuse_symlink(root / checkpoint_name(step), f"step={step}")
    elif step == "latest":
        name = latest_pointer(root)
        match = _STEP_NAME.fullmatch(name or "")
        if match is not None:
            path = root / match.group(0)
            _refuse_symlink(path, f"{LATEST_NAME} names it")
            if not (path / MANIFEST_NAME).is_file():
                steps = [c.step for c in list_checkpoints(root)]
                newest = (f"the newest committed step is {steps[-1]}: load(..., step={steps[-1]}) reads it" if steps
                          else "there is no committed checkpoint")  # fmt: skip
                state = "is missing" if not os.path.lexists(path) else f"has no {MANIFEST_NAME}"
                raise CheckpointError(
                    f"{root / LATEST_NAME} names step {int(match.group(1))}, but {path} {state}; not falling back "
                    f"to an older checkpoint ({newest})"
                )
            return Resolved(path, via_latest=True)
    return Resolved(resolve_checkpoint(root, step))


def _refuse_symlink(path: Path, why: str) -> None:
    """Raise CheckpointError if the step directory ``path`` is a symlink."""
    try:
        is_link = stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return  # resolve_checkpoint says it is missing, listing the committed steps
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot stat the checkpoint directory ({why}): {exc}") from exc
    if is_link:
        raise CheckpointError(
            f"{path} is a symlink ({why}); a checkpoint of a run directory must be a directory inside it. "
            "Pass the checkpoint directory itself to read it"
        )
