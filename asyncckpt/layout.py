"""Where checkpoints live in a directory, and how one becomes visible atomically.

::

    runs/exp1/
      step-0000000300/          one committed checkpoint: manifest.json + data files
      step-0000000400/
      .tmp-step-0000000500-<host>-<pid>-<nonce>/   a save in progress (never read)
      latest                    text: the name of the newest committed checkpoint

Why rename rather than a "commit" marker file: a directory rename is atomic on POSIX file
systems, so a reader sees either no ``step-*`` directory or a complete one, and a crash at any
moment leaves only a ``.tmp-*`` directory that every reader ignores. The ``latest`` pointer
is replaced the same way (write a temporary file, fsync, rename). If the pointer is missing or
names a directory that is gone, readers fall back to the highest committed step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError
from .manifest import MANIFEST_NAME, read_regular_file

log = logging.getLogger("asyncckpt")

LATEST_NAME = "latest"
MAX_STEP = 1 << 62
"""Largest step saved: the manifest reader's bound, and 19 digits, inside the ``step-*`` name pattern."""
_CKPT_DIR = re.compile(r"step-(\d{10,20})")
_TMP_DIR = re.compile(r"\.tmp-step-\d+-(?P<host>[^/]+)-(?P<pid>\d+)-[0-9a-f]+")


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


def checkpoint_name(step: int) -> str:
    return f"step-{step:010d}"


def temporary_dir(root: Path, step: int) -> Path:
    return root / f".tmp-{checkpoint_name(step)}-{_host_label()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Committed checkpoints under ``directory``, oldest step first."""
    root = Path(directory)
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        match = _CKPT_DIR.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and (Path(entry.path) / MANIFEST_NAME).is_file():
            found.append(CheckpointInfo(step=int(match.group(1)), path=Path(entry.path)))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(directory: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The checkpoint the ``latest`` pointer names, else the highest committed step, else None."""
    root = Path(directory)
    committed = list_checkpoints(root)
    name = latest_pointer(root)
    for info in committed:
        if info.path.name == name:
            return info
    return committed[-1] if committed else None


def latest_pointer(directory: str | os.PathLike[str]) -> str | None:
    """The name the ``latest`` pointer holds, or None when it is missing or unreadable."""
    try:
        return read_regular_file(Path(directory) / LATEST_NAME, 4096).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def pointer_reaches(directory: str | os.PathLike[str], step: int) -> bool:
    """Whether a reader of ``latest`` now gets ``step`` or a later one, once ``step`` is committed.

    False only while the pointer still names an earlier committed step: the short window between a
    commit's rename and its pointer update (see :func:`commit`), which a rank that learns of the
    commit from the renamed directory must wait out before it reads ``latest``.
    """
    root = Path(directory)
    name = latest_pointer(root)
    match = _CKPT_DIR.fullmatch(name or "")
    if match is None or int(match.group(1)) >= step:
        return True  # missing, unreadable or foreign: readers fall back to the highest committed step
    return not (root / match.group(0) / MANIFEST_NAME).is_file()


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """Step of the latest committed checkpoint under ``directory``, or None if there is none."""
    info = latest_checkpoint(directory)
    return None if info is None else info.step


def resolve_checkpoint(directory_or_checkpoint: str | os.PathLike[str], step: int | str = "latest") -> Path:
    """The checkpoint directory meant by a run directory plus ``step``, or a checkpoint path itself."""
    path = Path(directory_or_checkpoint)
    if (path / MANIFEST_NAME).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint or checkpoint directory")
    if step == "latest":
        info = latest_checkpoint(path)
        if info is None:
            raise CheckpointError(f"{path}: no committed checkpoint in this directory")
        return info.path
    if type(step) is not int:
        raise CheckpointError(f"step must be an int or 'latest', got {step!r}")
    candidate = path / checkpoint_name(step)
    if not (candidate / MANIFEST_NAME).is_file():
        steps = [c.step for c in list_checkpoints(path)]
        raise CheckpointError(f"{path}: no committed checkpoint for step {step} (committed steps: {steps})")
    return candidate


def commit(tmp_dir: Path, final_dir: Path) -> None:
    """Make a fully written, fsynced ``tmp_dir`` visible as ``final_dir`` and point ``latest`` at it."""
    publish(tmp_dir, final_dir)
    # From here on the checkpoint is committed: a pointer that cannot be written is a warning, and
    # the stale pointer is removed so readers fall back to the highest committed step.
    root = final_dir.parent
    pointer_tmp = root / f".{LATEST_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        with open(pointer_tmp, "w", encoding="utf-8") as f:
            f.write(final_dir.name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer_tmp, root / LATEST_NAME)
        fsync_dir(root)
    except OSError as exc:
        log.warning("asyncckpt: %s is committed, but the %r pointer could not be updated: %s", final_dir,
                    LATEST_NAME, exc)  # fmt: skip
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
    if final_dir.exists():
        if not replace:
            raise CheckpointError(
                f"{final_dir}: a checkpoint for this step was committed meanwhile; not overwriting it"
            )
        old = _move_aside(final_dir)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def apply_retention(directory: Path, keep_last: int | None, protect: Path) -> list[Path]:
    """Delete committed checkpoints beyond the newest ``keep_last``; returns what was deleted.

    Never deletes ``protect`` (the checkpoint just committed) or the newest committed one.
    """
    if keep_last is None:
        return []
    committed = list_checkpoints(directory)
    keep = {c.path for c in committed[-keep_last:]} | {protect}
    if committed:
        keep.add(committed[-1].path)
    deleted = []
    for info in committed:
        if info.path not in keep:
            delete_checkpoint_dir(info.path)
            deleted.append(info.path)
    return deleted


def _move_aside(path: Path) -> Path:
    """Rename ``path`` to a hidden ``.deleting-*`` name beside it and return that name.

    Rename first, delete after: a reader never sees a half-deleted directory as a checkpoint.
    """
    doomed = path.with_name(f".deleting-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, doomed)
    return doomed


def delete_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint directory without it ever looking half-deleted."""
    shutil.rmtree(_move_aside(path), ignore_errors=True)


def _host_label() -> str:
    """This host's name as it appears in temporary directory names (no ``-`` or ``/``)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove ``.tmp-*`` directories left by dead processes of this host (a crash mid-save)."""
    host = _host_label()
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            match = _TMP_DIR.fullmatch(entry.name)
            if match and match.group("host") == host and not _pid_alive(int(match.group("pid"))):
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
