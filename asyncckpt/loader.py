"""Load and verify checkpoints: read blobs, verify checksums, decode, rebuild the state.

Everything read from disk is treated as hostile: the manifest is validated first
(:mod:`asyncckpt.manifest`), every data file must be a regular file inside the checkpoint
directory, every blob must lie inside its file, and every chunk must decode to exactly its
recorded size. No pickle, no code from the checkpoint is ever run. Runs on the calling thread
(plus the codec's thread pool).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from . import checksum
from .codecs import check_expansion, get_decoder
from .dtypes import dtype_from_name
from .errors import CheckpointError, CorruptCheckpointError
from .manifest import Manifest, TensorRecord, read_manifest
from .observer import notify_load_finished
from .resolve import Resolved, resolve_for_reading
from .storage import BlobReader, PosixStorage, Storage, align_up
from .tree import unflatten

MapLocation = str | torch.device | None


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` checked."""

    path: Path
    step: int
    tensors: int
    raw_bytes: int
    stored_bytes: int
    format_version: int = 0
    manifest_digest: str | None = None
    """The manifest's SHA-256 that was checked, or None for a manifest of format 1 or 2, which has none."""

    @property
    def notes(self) -> list[str]:
        """What was not checked, for a report (``["no manifest digest (format v1)"]``)."""
        return [] if self.manifest_digest else [f"no manifest digest (format v{self.format_version})"]


def load(directory_or_checkpoint: str | os.PathLike[str], step: int | str = "latest",
         map_location: MapLocation = None) -> Any:  # fmt: skip
    """Load a checkpoint and return the state with its original structure.

    Args:
        directory_or_checkpoint: a run directory (then ``step`` picks the checkpoint) or one
            checkpoint directory.
        step: ``"latest"`` or a step number.
        map_location: device for every tensor (``"cpu"``, ``"cuda:0"``, a ``torch.device``);
            None restores each tensor to the device it was saved from.

    Raises:
        CorruptCheckpointError: a checksum, size or manifest check failed (names tensor and file).
        CheckpointError: no such checkpoint; a device or codec this machine lacks.
    """
    began = time.perf_counter()
    resolved = resolve_for_reading(directory_or_checkpoint, step)
    path = resolved.path
    with naming_fallback(resolved):
        manifest = read_manifest(path)
        tensors = load_tensors(path, manifest, map_location)

        def tensor_at(index: int) -> torch.Tensor:
            if not 0 <= index < len(tensors):
                raise CorruptCheckpointError(f"{path}: structure refers to tensor {index}, table has {len(tensors)}")
            return tensors[index]

        state = unflatten(manifest.structure, tensor_at, str(path))
    notify_load_finished(time.perf_counter() - began)  # for the asyncckpt_load_seconds metric
    return state


def load_tensors(checkpoint: Path, manifest: Manifest, map_location: MapLocation = None) -> list[torch.Tensor]:
    """Read, verify, decode and place every tensor of ``manifest.tensors``, in table order.

    ``manifest`` may list only part of a checkpoint's table (one rank's part of a distributed
    checkpoint, see :mod:`asyncckpt.distributed`); each record is verified as in :func:`load`.
    Runs on the calling thread.
    """
    target = None if map_location is None else torch.device(map_location)
    if _restores_on_gpu(manifest, target):
        from .gpu.restore import decode_on_device

        return decode_on_device(checkpoint, manifest, target)
    places = [destination(record, target, tensor_where(checkpoint, record)) for record in manifest.tensors]
    return [
        t if place.type == "cpu" else t.to(place)
        for t, place in zip(_decoded_tensors(checkpoint, manifest), places, strict=True)
    ]


def _restores_on_gpu(manifest: Manifest, target: torch.device | None) -> bool:
    """Whether tensors go to a GPU and the GPU path (KvikIO reads, nvCOMP decodes on the device) can run."""
    if target is not None:
        wants_cuda = target.type == "cuda"
    else:
        wants_cuda = any(record.device.startswith("cuda") for record in manifest.tensors)
    if not wants_cuda:
        return False
    from .gpu.deps import gpu_path_available  # imports nothing optional on a machine without CUDA

    return gpu_path_available()


def verify(path: str | os.PathLike[str], step: int | str = "latest") -> VerifyReport:
    """Check the manifest's digest, every blob's checksum and decodability and the structure.

    Rejects everything :func:`load` rejects on any machine (it does not need the devices the
    tensors were saved from); raises on the first problem.
    """
    resolved = resolve_for_reading(path, step)
    checkpoint = resolved.path
    with naming_fallback(resolved):
        manifest = read_manifest(checkpoint)
        count = sum(1 for _ in _decoded_tensors(checkpoint, manifest))
        unflatten(manifest.structure, _index_checker(count, checkpoint), str(checkpoint))
    return VerifyReport(path=checkpoint, step=manifest.step, tensors=count, raw_bytes=manifest.raw_bytes,
                        stored_bytes=manifest.stored_bytes, format_version=manifest.format_version,
                        manifest_digest=manifest.digest)  # fmt: skip


@contextmanager
def naming_fallback(resolved: Resolved) -> Iterator[None]:
    """A corrupt checkpoint reached through ``latest`` is an error that names the step to load instead."""
    try:
        yield
    except CorruptCheckpointError as exc:
        context = resolved.context()
        if not context:
            raise
        raise CorruptCheckpointError(f"{exc}{context}") from exc


def _index_checker(count: int, path: Path) -> Callable[[int], torch.Tensor]:
    def check(index: int) -> torch.Tensor:
        if not 0 <= index < count:
            raise CorruptCheckpointError(f"{path}: structure refers to tensor {index}, table has {count}")
        return torch.empty(0)

    return check


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
    it (:func:`asyncckpt.codecs.check_expansion`). Together with the manifest's own checks this
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


def _decoded_tensors(checkpoint: Path, manifest: Manifest) -> Iterator[torch.Tensor]:
    """Yield each tensor of the table, decoded into host memory in its saved dtype and shape."""
    storage: Storage = PosixStorage()
    files = check_layout(checkpoint, manifest.tensors)
    with ExitStack() as stack:
        readers: dict[str, BlobReader] = {}
        for record in manifest.tensors:
            where = tensor_where(checkpoint, record)
            if record.file not in readers:
                path = files[record.file][0]
                try:
                    readers[record.file] = storage.open_reader(path)
                except OSError as exc:
                    raise CorruptCheckpointError(f"{path}: cannot open the data file: {exc}") from exc
                stack.callback(readers[record.file].close)
            blob = readers[record.file].read(record.offset, record.stored_bytes)
            _check_blob(blob, record, where)
            yield _decode(blob, record, where)


def _check_blob(blob: torch.Tensor, record: TensorRecord, where: str) -> None:
    algorithm = checksum.check_algorithm(record.checksum.algorithm, where)
    checksum.verify_value(algorithm, record.checksum.value, checksum.compute(algorithm, blob), where)


def _decode(blob: torch.Tensor, record: TensorRecord, where: str) -> torch.Tensor:
    dtype = dtype_from_name(record.dtype, where)
    decoder = get_decoder(record.codec, where)
    try:
        out = torch.empty(record.raw_bytes, dtype=torch.uint8)
    except RuntimeError as exc:
        raise CheckpointError(f"{where}: cannot allocate {record.raw_bytes} bytes to decode it: {exc}") from exc
    try:
        decoder.decode(blob, [(s, r) for s, r in record.chunks], record.codec_params, out)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{where}: {exc}") from exc
    if record.raw_bytes == 0:
        return torch.empty(record.shape, dtype=dtype)
    return out.view(dtype).view(record.shape)


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
