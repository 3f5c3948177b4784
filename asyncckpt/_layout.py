"""Where checkpoints live in a directory: names, listing, the ``latest`` pointer as readers see it.

::

    runs/exp1/
      step-0000000300/          one committed checkpoint: manifest.json + data files
      step-0000000400/
      .tmp-step-0000000500-<host>-<pid>-<nonce>/   a save in progress (never read)
      latest                    text: the name of the newest committed checkpoint

How a checkpoint becomes visible is :mod:`asyncckpt._commit`; how checkpoints and leftovers are
deleted is :mod:`asyncckpt._retention`. If the pointer is missing or names a directory that is
gone, readers fall back to the highest committed step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from ._files import read_regular_file
from ._manifest import MANIFEST_NAME
from .errors import CheckpointError

log = logging.getLogger("asyncckpt")

LATEST_NAME = "latest"
MAX_STEP = 1 << 62
"""Largest step saved: the manifest reader's bound, and 19 digits, inside the ``step-*`` name pattern."""
CKPT_DIR = re.compile(r"step-(\d{10,20})")
_HOST = r"(?P<host>[A-Za-z0-9._]+)"
LEFTOVERS = (
    ("tmp", re.compile(rf"\.tmp-step-\d+-{_HOST}-(?P<pid>\d+)-[0-9a-f]+")),
    ("deleting", re.compile(rf"\.deleting-step-\d+-{_HOST}-(?P<pid>\d+)-[0-9a-f]{{8}}")),
    ("deleting", re.compile(r"\.deleting-step-\d+-[0-9a-f]{8}")),  # older versions': no owner, always doomed
    ("latest", re.compile(rf"\.latest\.(?:{_HOST}\.)?(?P<pid>\d+)\.[0-9a-f]{{8}}")),
    ("committing", re.compile(rf"\.committing-(?P<name>step-\d{{10,20}})-{_HOST}-(?P<pid>\d+)-[0-9a-f]{{8}}")),
)
"""What a killed save can leave in a run directory (:func:`asyncckpt._retention.remove_stale_temporaries`)."""
COMMITTING = LEFTOVERS[-1][1]


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path


def checkpoint_name(step: int) -> str:
    return f"step-{step:010d}"


def temporary_dir(root: Path, step: int) -> Path:
    return root / f".tmp-{checkpoint_name(step)}-{host_label()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Committed checkpoints under ``directory``, oldest step first."""
    root = Path(directory)
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        match = CKPT_DIR.fullmatch(entry.name)
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

    A committed step with a ``.committing-*`` marker (:func:`asyncckpt._commit.commit`: renamed, pointer not yet
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
            match = COMMITTING.fullmatch(entry.name)
            if match and (root / match.group("name") / MANIFEST_NAME).is_file():
                names.append(match.group("name"))
    return max(names, key=lambda n: int(n[len("step-") :]), default=None)


def pointer_reaches(directory: str | os.PathLike[str], step: int) -> bool:
    """Whether a reader of ``latest`` now gets ``step`` or a later one, once ``step`` is committed.

    False only while the pointer still names an earlier committed step: never during a commit of
    :func:`asyncckpt._commit.commit`, whose marker makes :func:`latest_pointer` name the renamed step at once, but
    during one by an asyncckpt without the marker, between its rename and its pointer update,
    which a rank that learns of the commit from the renamed directory must wait out.
    """
    root = Path(directory)
    name = latest_pointer(root)
    match = CKPT_DIR.fullmatch(name or "")
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


def move_aside(path: Path) -> Path:
    """Rename ``path`` to a hidden ``.deleting-*`` name beside it and return that name.

    Rename first, delete after: a reader never sees a half-deleted directory as a checkpoint. The
    name holds this host and pid, so a later checkpointer removes it only once this process is dead.
    """
    doomed = path.with_name(f".deleting-{path.name}-{host_label()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.rename(path, doomed)
    return doomed


def host_label() -> str:
    """This host's name as it appears in temporary directory names (no ``-`` or ``/``)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def is_commit_marker(name: str) -> bool:
    """Whether ``name`` is a ``.committing-*`` marker's (see :func:`asyncckpt._commit.commit`)."""
    return COMMITTING.fullmatch(name) is not None
