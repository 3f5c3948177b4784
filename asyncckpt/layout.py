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

from .commit_points import reached
from .errors import CheckpointError
from .manifest import MANIFEST_NAME, read_manifest, read_regular_file

log = logging.getLogger("asyncckpt")

LATEST_NAME = "latest"
MAX_STEP = 1 << 62
"""Largest step saved: the manifest reader's bound, and 19 digits, inside the ``step-*`` name pattern."""
_CKPT_DIR = re.compile(r"step-(\d{10,20})")
_HOST = r"(?P<host>[A-Za-z0-9._]+)"
_LEFTOVERS = (
    ("tmp", re.compile(rf"\.tmp-step-\d+-{_HOST}-(?P<pid>\d+)-[0-9a-f]+")),
    ("deleting", re.compile(rf"\.deleting-step-\d+-{_HOST}-(?P<pid>\d+)-[0-9a-f]{{8}}")),
    ("deleting", re.compile(r"\.deleting-step-\d+-[0-9a-f]{8}")),  # older versions': no owner, always doomed
    ("latest", re.compile(rf"\.latest\.(?:{_HOST}\.)?(?P<pid>\d+)\.[0-9a-f]{{8}}")),
    ("committing", re.compile(rf"\.committing-(?P<name>step-\d{{10,20}})-{_HOST}-(?P<pid>\d+)-[0-9a-f]{{8}}")),
)
"""What a killed save can leave in a run directory (:func:`remove_stale_temporaries`)."""
_COMMITTING = _LEFTOVERS[-1][1]


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
    """The checkpoint :func:`latest_pointer` names, else the highest committed step, else None.

    After a save at a lower step than the newest (a restart from an earlier checkpoint), the
    pointer names that lower step: latest is the most recently committed, not the highest.
    """
    root = Path(directory)
    committed = list_checkpoints(root)
    name = latest_pointer(root)
    for info in committed:
        if info.path.name == name:
            return info
    return committed[-1] if committed else None


def latest_pointer(directory: str | os.PathLike[str]) -> str | None:
    """The name of the latest checkpoint by the ``latest`` pointer, or None when it is missing or unreadable.

    A committed step with a ``.committing-*`` marker (:func:`commit`: renamed, pointer not yet
    moved, perhaps never, if its process was killed) is named instead of what the file holds.
    """
    root = Path(directory)
    committing = _committing_step(root)
    return committing if committing is not None else latest_pointer_file(root)


def latest_pointer_file(directory: str | os.PathLike[str]) -> str | None:
    """What the ``latest`` file holds (no marker considered), or None when it is missing or unreadable."""
    try:
        return read_regular_file(Path(directory) / LATEST_NAME, 4096).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _committing_step(root: Path) -> str | None:
    """The newest committed step a ``.committing-*`` marker names, if any."""
    names = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            match = _COMMITTING.fullmatch(entry.name)
            if match and (root / match.group("name") / MANIFEST_NAME).is_file():
                names.append(match.group("name"))
    return max(names, key=lambda n: int(n[len("step-") :]), default=None)


def pointer_reaches(directory: str | os.PathLike[str], step: int) -> bool:
    """Whether a reader of ``latest`` now gets ``step`` or a later one, once ``step`` is committed.

    False only while the pointer still names an earlier committed step: never during a commit of
    :func:`commit`, whose marker makes :func:`latest_pointer` name the renamed step at once, but
    during one by an asyncckpt without the marker, between its rename and its pointer update,
    which a rank that learns of the commit from the renamed directory must wait out.
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
    """Make a fully written ``tmp_dir`` visible as ``final_dir`` and point ``latest`` at it. Worker thread.

    Between the rename and the pointer update a ``.committing-step-*`` marker exists: a process
    killed there leaves ``latest`` one step behind a committed directory, and the marker makes
    readers (:func:`latest_pointer`) take the committed step instead, until the next checkpointer
    moves the pointer forward (:func:`remove_stale_temporaries`). Without it, a job resuming at
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
    marker = root / f".committing-{final_dir.name}-{_host_label()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
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
    pointer_tmp = root / f".{LATEST_NAME}.{_host_label()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
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
        old = _move_aside(final_dir)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
    match = _CKPT_DIR.fullmatch(protect.name)
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


def _move_aside(path: Path) -> Path:
    """Rename ``path`` to a hidden ``.deleting-*`` name beside it and return that name.

    Rename first, delete after: a reader never sees a half-deleted directory as a checkpoint. The
    name holds this host and pid, so a later checkpointer removes it only once this process is dead.
    """
    doomed = path.with_name(f".deleting-{path.name}-{_host_label()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.rename(path, doomed)
    return doomed


def delete_checkpoint_dir(path: Path) -> None:
    """Delete a checkpoint directory without it ever looking half-deleted; a symlink: only the link."""
    if path.is_symlink():
        path.unlink()  # never follow it: its target is not ours to delete
        return
    doomed = _move_aside(path)
    reached("retention-moved-aside")
    shutil.rmtree(doomed, ignore_errors=True)


def _host_label() -> str:
    """This host's name as it appears in temporary directory names (no ``-`` or ``/``)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


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
    host = _host_label()
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            found = next(((kind, m) for kind, m in ((k, r.fullmatch(entry.name)) for k, r in _LEFTOVERS) if m), None)
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


def is_commit_marker(name: str) -> bool:
    """Whether ``name`` is a ``.committing-*`` marker's (see :func:`commit`)."""
    return _COMMITTING.fullmatch(name) is not None


def finish_interrupted_commit(root: Path, marker_name: str) -> None:
    """Complete the commit a ``.committing-*`` marker records, whose process is gone, and remove the marker.

    If its step is committed, ``latest`` is pointed at it: the marker means that step was the most
    recent commit (even below a higher step, after a restart from an earlier checkpoint). If not,
    the process died before its rename and nothing was committed. Calling thread.
    """
    match = _COMMITTING.fullmatch(marker_name)
    if match is None:
        raise ValueError(f"{marker_name!r} is not a commit marker")
    name = match.group("name")
    if (root / name / MANIFEST_NAME).is_file() and latest_pointer_file(root) != name:
        _point_latest(root, name)
        log.info("asyncckpt: %s was committed by a process stopped before it updated %r; %r names it now",
                 root / name, LATEST_NAME, LATEST_NAME)  # fmt: skip
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / marker_name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
