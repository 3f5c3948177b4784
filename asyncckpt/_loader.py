"""Load and verify checkpoints: read blobs, verify checksums, decode, rebuild the state.

Everything read from disk is treated as hostile: the manifest is validated first
(:mod:`asyncckpt._manifest`), every data file must be a regular file inside the checkpoint
directory, every blob must lie inside its file, and every chunk must decode to exactly its
recorded size. No pickle, no code from the checkpoint is ever run. Runs on the calling thread
(plus the codec's thread pool).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._delta_chain import ChainReader
from ._dtypes import dtype_from_name
from ._manifest import Manifest, read_manifest
from ._read_layout import check_layout, destination, tensor_where
from ._resolve import Resolved, resolve_for_reading
from ._tree import unflatten
from .errors import CorruptCheckpointError
from .observer import notify_load_finished

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
        from ._gpu.restore import decode_chain_on_device

        return decode_chain_on_device(checkpoint, manifest, target)
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
    from ._gpu.deps import gpu_path_available  # imports nothing optional on a machine without CUDA

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


def _decoded_tensors(checkpoint: Path, manifest: Manifest) -> Iterator[torch.Tensor]:
    """Yield each tensor of the table, decoded into host memory in its saved dtype and shape.

    A delta record (format 4) is decoded against its base checkpoint, and that against its own
    base, as far as the chain goes (:class:`asyncckpt._delta_chain.ChainReader`).
    """
    check_layout(checkpoint, manifest.tensors)  # every blob's place checked before any is read
    with ChainReader(checkpoint, manifest) as chain:
        for record in manifest.tensors:
            where = tensor_where(checkpoint, record)
            dtype = dtype_from_name(record.dtype, where)
            out = chain.raw(record)
            if record.raw_bytes == 0:
                yield torch.empty(record.shape, dtype=dtype)
            else:
                yield out.view(dtype).view(record.shape)
