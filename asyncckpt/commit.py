"""How a fully written checkpoint becomes visible, atomically, and ``latest`` moves to it.

Why rename rather than a "commit" marker file: a directory rename is atomic on POSIX file
systems, so a reader sees either no ``step-*`` directory or a complete one, and a crash at any
moment leaves only a ``.tmp-*`` directory that every reader ignores. The ``latest`` pointer is
replaced the same way (write a temporary file, fsync, rename). All functions run on the calling
thread (the checkpoint worker, for a save).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from pathlib import Path

from .commit_points import reached
from .errors import CheckpointError
from .layout import COMMITTING, LATEST_NAME, fsync_dir, host_label, latest_pointer_file, move_aside
from .manifest import MANIFEST_NAME

log = logging.getLogger("asyncckpt")


def commit(tmp_dir: Path, final_dir: Path) -> None:
    """Make a fully written ``tmp_dir`` visible as ``final_dir`` and point ``latest`` at it. Worker thread.

    Between the rename and the pointer update a ``.committing-step-*`` marker exists: a process
    killed there leaves ``latest`` one step behind a committed directory, and the marker makes
    readers (:func:`latest_pointer`) take the committed step instead, until the next checkpointer
    moves the pointer forward (:func:`asyncckpt.retention.remove_stale_temporaries`). Without it, a job resuming at
    ``latest_step() + 1`` found that step "already saved" forever.

    A pointer that cannot be written is a warning (it is removed, so readers fall back to the
    highest step), and so is a failed fsync of the run directory after the rename: the new
    directory is then visible to every reader and the step counts as saved, but the rename may
    not survive a power loss.
    """
    fsync_dir(tmp_dir)
    root = final_dir.parent
    if os.path.lexists(final_dir):
        raise CheckpointError(f"{final_dir}: a checkpoint for this step was committed meanwhile; not overwriting it")
    marker = root / f".committing-{final_dir.name}-{host_label()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(marker, "xb"):
        pass  # an empty file: its name says it all
    try:
        reached("marker-written")
        os.rename(tmp_dir, final_dir)
        try:
            reached("renamed")
            fsync_dir(root)
        except OSError as exc:
            log.warning("asyncckpt: %s is committed and visible, but fsync of %s failed (%s): the rename may not "
                        "survive a power loss", final_dir, root, exc)  # fmt: skip
        _point_latest(root, final_dir.name)
        reached("pointer-replaced")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(marker)
    reached("committed")


def _point_latest(root: Path, name: str) -> None:
    """Atomically replace ``root/latest`` with ``name``; on failure remove it (a warning, not an error)."""
    pointer_tmp = root / f".{LATEST_NAME}.{host_label()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        with open(pointer_tmp, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        reached("pointer-temp-written")
        os.replace(pointer_tmp, root / LATEST_NAME)
        fsync_dir(root)
    except OSError as exc:
        log.warning("asyncckpt: the %r pointer in %s could not be set to %s (readers fall back to the highest "
                    "committed step): %s", LATEST_NAME, root, name, exc)  # fmt: skip
        for stale in (pointer_tmp, root / LATEST_NAME):
            with contextlib.suppress(OSError):
                os.unlink(stale)


def publish(tmp_dir: Path, final_dir: Path, *, replace: bool = False) -> None:
    """Rename a fully written ``tmp_dir`` to ``final_dir`` durably (no ``latest`` pointer).

    With ``replace``, an existing ``final_dir`` is first renamed aside and deleted after the new
    one is in place: a reader sees the old checkpoint, briefly none, or the new one, never a mix
    (POSIX cannot rename a directory over a non-empty one atomically).
    """
    fsync_dir(tmp_dir)
    old = None
    if os.path.lexists(final_dir):
        if not replace:
            raise CheckpointError(
                f"{final_dir}: a checkpoint for this step was committed meanwhile; not overwriting it"
            )
        old = move_aside(final_dir)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def finish_interrupted_commit(root: Path, marker_name: str) -> None:
    """Complete the commit a ``.committing-*`` marker records, whose process is gone, and remove the marker.

    If its step is committed, ``latest`` is pointed at it: the marker means that step was the most
    recent commit (even below a higher step, after a restart from an earlier checkpoint). If not,
    the process died before its rename and nothing was committed. Calling thread.
    """
    match = COMMITTING.fullmatch(marker_name)
    if match is None:
        raise ValueError(f"{marker_name!r} is not a commit marker")
    name = match.group("name")
    if (root / name / MANIFEST_NAME).is_file() and latest_pointer_file(root) != name:
        _point_latest(root, name)
        log.info("asyncckpt: %s was committed by a process stopped before it updated %r; %r names it now",
                 root / name, LATEST_NAME, LATEST_NAME)  # fmt: skip
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / marker_name)
