"""How a fully written checkpoint becomes visible, atomically, and ``latest`` moves to it.

:func:`commit_checkpoint` is the one commit step every save path runs once its data files are
durable in a temporary directory (single-process and targeted saves in :mod:`asyncckpt._persist`,
the distributed rank-0 commit, the DCP coordinator): extra files, the sealed manifest, then
:func:`commit` (run directory: ``latest`` moves) or :func:`publish` (a path of the caller's).

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
from collections.abc import Mapping
from pathlib import Path

from ._commit_points import reached
from ._files import fsync_dir, write_durably
from ._layout import (
    COMMITTING,
    LATEST_NAME,
    checkpoint_name,
    host_label,
    latest_pointer_file,
    move_aside,
)
from ._manifest import MANIFEST_NAME, Manifest, Reference, manifest_json, read_manifest
from .errors import CheckpointError

log = logging.getLogger("asyncckpt")


def commit_checkpoint(tmp_dir: Path, manifest: Manifest, final_dir: Path, *, files: Mapping[str, bytes] | None = None,
                      point_latest: bool = True, replace: bool = False) -> bytes:  # fmt: skip
    """Finish ``tmp_dir``, whose data files are durable, as the checkpoint ``final_dir``. Worker thread.

    Writes ``files`` (small extra files, names already checked) and the sealed manifest, each
    fsynced; a delta manifest is refused if its base is no longer the checkpoint it was encoded
    against (:func:`check_base_present`). Then ``point_latest`` commits into a run directory
    (:func:`commit`: ``latest`` moves, crash windows covered by the commit marker); otherwise
    :func:`publish` renames it to the caller's path, ``replace`` allowing an older checkpoint
    there to be replaced whole. Returns the manifest's bytes (the next delta refers to their
    digest). On any error ``tmp_dir`` is removed and the error propagates: nothing became visible.
    """
    try:
        for name, data in (files or {}).items():
            write_durably(tmp_dir / name, data)
        manifest_bytes = manifest_json(manifest, final_dir)  # sealed; refused if load() would refuse its size
        if manifest.reference is not None:
            check_base_present(final_dir.parent, manifest.reference, final_dir)
        write_durably(tmp_dir / MANIFEST_NAME, manifest_bytes)
        reached("manifest-written")
        if point_latest:
            commit(tmp_dir, final_dir)
        else:
            publish(tmp_dir, final_dir, replace=replace)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return manifest_bytes


def check_base_present(root: Path, reference: Reference, final: Path) -> None:
    """Raise CheckpointError unless the base of a delta checkpoint is still in ``root`` as written.

    The reference store remembers the base it wrote; another process (a second checkpointer on the
    same directory, a user deleting files) may have removed or replaced it since, and a checkpoint
    whose base is gone would be reported saved and could not load. A deletion between this check
    and the commit is not caught here (``load`` and ``verify`` still report it, naming the base).
    """
    base = root / checkpoint_name(reference.step)
    try:
        digest = read_manifest(base).digest
    except (CheckpointError, OSError) as exc:
        digest, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = f"its manifest digest is {digest}"
    if digest != reference.manifest_sha256:
        raise CheckpointError(
            f"{final}: a delta against step {reference.step}, but that checkpoint is no longer the one it was encoded "
            f"against ({why}); another process deleted or replaced it. Not committed; the next save is full"
        )


def commit(tmp_dir: Path, final_dir: Path) -> None:
    """Make a fully written ``tmp_dir`` visible as ``final_dir`` and point ``latest`` at it. Worker thread.

    Between the rename and the pointer update a ``.committing-step-*`` marker exists: a process
    killed there leaves ``latest`` one step behind a committed directory, and the marker makes
    readers (:func:`latest_pointer`) take the committed step instead, until the next checkpointer
    moves the pointer forward (:func:`asyncckpt._retention.remove_stale_temporaries`). Without it, a job resuming at
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
    try:
        os.rename(tmp_dir, final_dir)
    except BaseException:
        if old is not None:  # put the checkpoint being replaced back: it stays the visible one
            os.rename(old, final_dir)
        raise
    try:
        fsync_dir(final_dir.parent)
    except OSError as exc:  # visible already: a warning, as in commit()
        log.warning("asyncckpt: %s is published and visible, but fsync of %s failed (%s): the rename may not "
                    "survive a power loss", final_dir, final_dir.parent, exc)  # fmt: skip
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
