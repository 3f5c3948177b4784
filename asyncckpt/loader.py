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
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import checksum
from .codecs import get_decoder
from .dtypes import dtype_from_name
from .errors import CheckpointError, CorruptCheckpointError
from .layout import resolve_checkpoint
from .manifest import Manifest, TensorRecord, read_manifest
from .observer import notify_load_finished
from .storage import BlobReader, PosixStorage, Storage
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
    path = resolve_checkpoint(directory_or_checkpoint, step)
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
    """Check every blob's checksum and decodability and the structure; raise on the first problem."""
    checkpoint = resolve_checkpoint(path, step)
    manifest = read_manifest(checkpoint)
    count = sum(1 for _ in _decoded_tensors(checkpoint, manifest))
    unflatten(manifest.structure, _index_checker(count, checkpoint), str(checkpoint))
    return VerifyReport(path=checkpoint, step=manifest.step, tensors=count, raw_bytes=manifest.raw_bytes,
                        stored_bytes=manifest.stored_bytes)  # fmt: skip


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
    if not stat.S_ISREG(info.st_mode):
        raise CorruptCheckpointError(f"{checkpoint}: data file {name!r} is not a regular file")
    return path, info.st_size


def check_within_file(record: TensorRecord, file_bytes: int, where: str) -> None:
    """Raise CorruptCheckpointError if ``record``'s blob does not lie inside its data file."""
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
    with ExitStack() as stack:
        readers: dict[str, tuple[BlobReader, int]] = {}
        for record in manifest.tensors:
            where = tensor_where(checkpoint, record)
            if record.file not in readers:
                path, size = _data_file(checkpoint, record.file)
                reader = storage.open_reader(path)
                stack.callback(reader.close)
                readers[record.file] = (reader, size)
            reader, size = readers[record.file]
            check_within_file(record, size, where)
            blob = reader.read(record.offset, record.stored_bytes)
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
