"""Where a checkpoint's blobs lie and where its tensors go: the checks every reader makes first.

Shared by the host loader (:mod:`asyncckpt._loader`) and the GPU restore
(:mod:`asyncckpt._gpu.restore`) so that both refuse the same manifests before reading a byte.
Runs on the calling thread.
"""

from __future__ import annotations

import os
import stat
from itertools import pairwise
from pathlib import Path

import torch

from ._codecs import check_expansion
from ._manifest import TensorRecord
from ._storage import align_up
from .errors import CheckpointError, CorruptCheckpointError

__all__ = ["check_layout", "check_within_file", "destination", "tensor_where"]


def _data_file(checkpoint: Path, name: str) -> tuple[Path, int]:
    """The path and size of a data file, which must be a regular file directly inside ``checkpoint``."""
    path = checkpoint / name
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{checkpoint}: data file {name!r} named in the manifest is missing") from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot stat the data file: {exc}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise CorruptCheckpointError(f"{checkpoint}: data file {name!r} is not a regular file")
    return path, info.st_size


def check_layout(checkpoint: Path, records: list[TensorRecord]) -> dict[str, tuple[Path, int]]:
    """Check where every blob lies before any is read; returns each data file's path and size.

    Every blob must lie inside its file (:func:`check_within_file`), no two non-empty blobs may
    share a byte (a writer never shares them, and 256 records of one blob would make a reader
    decode it 256 times), and no chunk may claim more raw bytes than its codec can produce from
    it (:func:`asyncckpt._codecs.check_expansion`). Together with the manifest's own checks this
    bounds what a reader reads, allocates and decodes by the bytes the files really hold. Costs
    one sort of the table. Runs on the calling thread.
    """
    files: dict[str, tuple[Path, int]] = {}
    by_file: dict[str, list[TensorRecord]] = {}
    for record in records:
        where = tensor_where(checkpoint, record)
        if record.file not in files:
            files[record.file] = _data_file(checkpoint, record.file)
        check_within_file(record, files[record.file][1], where)
        check_expansion(record.codec, record.chunks, where)
        if record.stored_bytes:
            by_file.setdefault(record.file, []).append(record)
    for blobs in by_file.values():
        blobs.sort(key=lambda r: r.offset)
        for before, after in pairwise(blobs):
            if after.offset < before.offset + before.stored_bytes:
                raise CorruptCheckpointError(
                    f"{tensor_where(checkpoint, after)}: blob at offset {after.offset} overlaps the blob of "
                    f"{before.key!r} at offset {before.offset} ({before.stored_bytes} bytes); the manifest is corrupt"
                )
    return files


def check_within_file(record: TensorRecord, file_bytes: int, where: str) -> None:
    """Raise CorruptCheckpointError if ``record``'s blob does not lie inside its data file.

    A blob of 0 bytes (an empty tensor stored raw) lies inside its file at any offset up to the
    file's end rounded up to the 4096-byte alignment: a writer places it at the next aligned
    offset, which is past the end when it is the file's last blob, and no byte of it is read.
    """
    if record.stored_bytes == 0 and record.offset <= align_up(file_bytes):
        return
    if record.offset + record.stored_bytes > file_bytes:
        raise CorruptCheckpointError(
            f"{where}: blob at offset {record.offset} of {record.stored_bytes} bytes extends past the end "
            f"of the file ({file_bytes} bytes); the file is truncated"
        )


def tensor_where(checkpoint: Path, record: TensorRecord) -> str:
    """How errors name a tensor: the checkpoint, its key and its data file."""
    return f"{checkpoint}: tensor {record.key!r} in {record.file}"


def destination(record: TensorRecord, target: torch.device | None, where: str) -> torch.device:
    """The device a tensor is restored to: ``map_location`` if given, else where it was saved from."""
    try:
        device = target if target is not None else torch.device(record.device)
    except RuntimeError as exc:
        raise CorruptCheckpointError(f"{where}: invalid device {record.device!r}") from exc
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise CheckpointError(
                f"{where}: was saved from {record.device} but CUDA is not available here; pass map_location='cpu'"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= count:
            raise CheckpointError(
                f"{where}: saved from {device}, but this machine has {count} CUDA device(s); "
                "pass map_location='cuda:0' (or 'cpu')"
            )
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise CheckpointError(f"{where}: cannot place a tensor on {device}")
    return device
