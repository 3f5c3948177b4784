"""Deleting checkpoints: retention (``keep_last``), a discarded timeline, and what killed saves left.

A checkpoint is never seen half-deleted: it is renamed to a hidden ``.deleting-*`` name first
(:func:`asyncckpt._layout.move_aside`), then removed. All functions run on the calling thread.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ._commit import finish_interrupted_commit
from ._commit_points import reached
from ._layout import CKPT_DIR, LEFTOVERS, checkpoint_name, host_label, list_checkpoints, move_aside
from ._manifest import read_manifest
from .errors import CheckpointError


def apply_retention(directory: Path, keep_last: int | None, protect: Path) -> list[Path]:
    """Delete checkpoints of this timeline beyond the newest ``keep_last``; returns what was deleted.

    This timeline is the committed steps up to ``protect`` (the checkpoint just committed). Steps
    above it were saved before a restart from an earlier checkpoint (an abandoned timeline): they
    are neither counted nor deleted here, since the new timeline's checkpoints are the ones to
    keep; :func:`discard_steps_after` removes them when asked. Symlinks are never checkpoints
    (:func:`list_checkpoints`), so retention never follows or deletes one. A checkpoint that a kept
    one depends on (its delta ``reference``, transitively) is kept too, so every kept step loads,
    and so is one that a checkpoint of the abandoned timeline depends on, so every listed step loads.
    """
    if keep_last is None:
        return []
    match = CKPT_DIR.fullmatch(protect.name)
    ceiling = int(match.group(1)) if match else None
    listed = list_checkpoints(directory)
    timeline = [c for c in listed if ceiling is None or c.step <= ceiling]
    keep = {c.path for c in timeline[-keep_last:]} | {protect}
    abandoned = {c.path for c in listed if ceiling is not None and c.step > ceiling}  # still listed: keep them loadable
    keep |= _bases_of(directory, keep | abandoned)
    deleted = []
    for info in timeline:
        if info.path not in keep:
            delete_checkpoint_dir(info.path)
            deleted.append(info.path)
    return deleted


def _bases_of(directory: Path, kept: set[Path]) -> set[Path]:
    """The checkpoints the ``kept`` ones refer to as delta bases, transitively (at most 64 hops each).

    A manifest that cannot be read protects nothing: it cannot load anyway, and its base stays
    only if something readable needs it.
    """
    bases: set[Path] = set()
    for path in kept:
        current = path
        for _ in range(64):
            try:
                reference = read_manifest(current).reference
            except (CheckpointError, OSError):
                break
            if reference is None:
                break
            current = directory / checkpoint_name(reference.step)
            if current in bases:
                break
            bases.add(current)
    return bases


def discard_steps_after(directory: str | os.PathLike[str], step: int) -> list[int]:
    """Delete the committed checkpoints above ``step`` (an abandoned timeline); returns their steps.

    For a run restarted from checkpoint ``step``: its later steps would otherwise be refused as
    "already saved" when the new timeline reaches them. Calling thread; no save may be in flight.
    Every rank of a distributed run calls it on the same directory, so a checkpoint another process
    has just moved aside is taken as deleted, not as an error.
    """
    doomed = [c for c in list_checkpoints(directory) if c.step > step]
    for info in doomed:
        with contextlib.suppress(FileNotFoundError):  # another rank deleted it since the listing
            delete_checkpoint_dir(info.path)
    return [c.step for c in doomed]


def delete_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint directory without it ever looking half-deleted; a symlink: only the link."""
    if path.is_symlink():
        path.unlink()  # never follow it: its target is not ours to delete
        return
    doomed = move_aside(path)
    reached("retention-moved-aside")
    shutil.rmtree(doomed, ignore_errors=True)


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove what dead processes of this host left in ``directory``; returns the paths removed.

    The kinds a single-process save leaves when killed: ``.tmp-step-*`` directories (a save in
    progress), ``.deleting-step-*`` directories (retention in progress), ``.latest.*`` files (a
    pointer update in progress) and ``.committing-step-*`` markers (a commit whose pointer update
    may not have happened: ``latest`` is moved to its step first, if that step is committed).
    Each name holds its owner's host and pid, and only those whose owner is on this host and no
    longer running are removed: never another live process's, never another host's (its pids
    mean nothing here), never the distributed protocol's (rank 0 cleans those, by session), and
    never a symlink (not ours). A recycled pid keeps a leftover until the next start; that errs
    on the safe side.
    """
    host = host_label()
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            found = next(((kind, m) for kind, m in ((k, r.fullmatch(entry.name)) for k, r in LEFTOVERS) if m), None)
            if found is None or entry.is_symlink():
                continue
            kind, match = found
            owner = match.groupdict()
            if (owner.get("host") or host) != host or (owner.get("pid") and _pid_alive(int(owner["pid"]))):
                continue
            if kind == "committing":
                finish_interrupted_commit(directory, entry.name)
            elif kind == "latest":
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            else:
                shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
