"""Persist one snapshot as a committed checkpoint: compress, write, fsync, manifest, commit.

:func:`write_part` writes a snapshot's data file; a :class:`Committer` (the run directory's,
a distributed rank's, an integration's) turns it into a checkpoint through
:func:`asyncckpt._commit.commit_checkpoint`. Runs on the checkpoint worker thread, one snapshot
at a time, so checkpoints commit in the order they were saved. No collectives run here.
Either the whole checkpoint becomes visible (one directory rename) or, on any error, its
temporary directory is removed and the previous checkpoint stays the latest.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from . import _checksum as checksum
from ._codecs import EncodedBlob, Encoder, NoneCodec
from ._commit import commit_checkpoint
from ._commit_points import reached
from ._data_path import Backend
from ._delta_encode import DeltaSave, DeltaWriter
from ._dtypes import dtype_name
from ._layout import checkpoint_name, temporary_dir
from ._manifest import MANIFEST_NAME, Checksum, Manifest, TensorRecord
from ._retention import apply_retention
from ._snapshot import Snapshot
from ._storage import Storage
from ._tree import FlatState
from ._version import __version__
from .result import SaveResult

DATA_FILE = "data-0.bin"
_EXTRA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


log = logging.getLogger("asyncckpt")


@dataclass
class SaveJob:
    """Everything the worker needs to persist one save; built on the training thread."""

    step: int
    structure: dict[str, Any] | FlatState
    """The skeleton, or the flattened state to build it from on the worker (see :attr:`skeleton`)."""
    snapshot: Snapshot
    metadata: dict[str, Any]
    created_unix: float
    started: float
    """``time.perf_counter()`` at save() entry."""
    stall_seconds: float
    snapshot_seconds: float
    snapshot_mode: str
    snapshot_reason: str = ""
    full: bool = False
    """``save(..., full=True)``: no delta records, whatever the checkpointer's ``delta`` option."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Small extra files (name -> bytes) written into the checkpoint directory before its manifest,
    e.g. a framework's own JSON state; names are plain file names (checked by :func:`check_extra_files`)."""

    @property
    def skeleton(self) -> dict[str, Any]:
        """The state's skeleton; built here, on the worker thread, when ``save()`` left it to be built."""
        return self.structure.skeleton if isinstance(self.structure, FlatState) else self.structure


_identity = NoneCodec()


def blob_checksum(blob: EncodedBlob) -> Checksum:
    """CRC-32 of the stored bytes: the encoder's, else computed where they are (host: zlib; device: nvCOMP)."""
    if blob.crc32 is not None:
        return Checksum("crc32", blob.crc32)
    if blob.data.is_cuda:
        from ._gpu.checksum import crc32_device  # only reachable when the GPU path produced the blob

        return Checksum("crc32", crc32_device(blob.data))
    return Checksum("crc32", checksum.compute("crc32", blob.data))


def encode_all(encoder: Encoder, snapshot: Snapshot) -> Iterator[EncodedBlob]:
    """The blobs of ``snapshot.tensors`` in order. An encoder with ``encode_snapshot`` (the GPU
    pipeline) compresses in batches, ahead of the writer; any other encodes one tensor at a time."""
    return iter(encoder.encode_snapshot(snapshot))


@dataclass
class WrittenPart:
    """The tensors of one snapshot, durable in one data file (not yet committed)."""

    records: list[TensorRecord]
    codecs: Counter[str]
    stage_seconds: dict[str, float]
    """compress, write and fsync seconds."""


def write_part(snapshot: Snapshot, encoder: Encoder, storage: Storage, path: Path,
               delta: DeltaSave | None = None) -> WrittenPart:  # fmt: skip
    """Encode every staged tensor into the new data file ``path`` and fsync it. Worker thread.

    With ``delta`` (an incremental save, :mod:`asyncckpt._delta_encode`), each tensor is encoded
    by it, as a delta where that wins, and recorded as the next save's reference; an encoder with
    ``encode_snapshot`` (the GPU pipeline) does that itself, and its blobs carry their ``delta``.

    Whatever happens, the snapshot is released (its staging memory reusable) when this returns or
    raises, and only then, because a ``none``-coded blob aliases the staging memory. On failure the
    partial data file is removed.
    """
    stages = {"compress": 0.0, "write": 0.0, "fsync": 0.0}
    try:
        snapshot.wait_ready()
        # A fence snapshot's bytes are live tensors that training overwrites once they are compressed,
        # so an incompressible blob stays as encoded instead of being re-read raw.
        stable = snapshot.stable
        writer = storage.open_writer(path)
        try:
            records, codecs = [], Counter[str]()
            per_tensor = None if encoder.batched else delta
            if per_tensor is not None:
                per_tensor.exclude_duplicates(t.key for t in snapshot.tensors)
            blobs = encode_all(encoder, snapshot) if per_tensor is None else iter(())
            for staged in snapshot.tensors:
                began = time.perf_counter()
                blob = next(blobs) if per_tensor is None else per_tensor.encode(encoder, staged, stable)
                if blob.delta is None and blob.codec != "none" and blob.stored_bytes >= staged.data.numel() and \
                        stable:  # fmt: skip
                    blob = _identity.encode(staged.data, staged.dtype, staged.key)  # incompressible: store raw
                digest = blob_checksum(blob)
                written = time.perf_counter()
                offset = writer.append(blob.data)  # the writer keeps blob.data alive until it is written
                stages["compress"] += written - began
                stages["write"] += time.perf_counter() - written
                codecs[blob.codec] += 1
                records.append(TensorRecord(
                    key=staged.key, dtype=dtype_name(staged.dtype) or "", shape=list(staged.shape),
                    device=str(staged.device), file=path.name, offset=offset, stored_bytes=blob.stored_bytes,
                    raw_bytes=staged.data.numel(), codec=blob.codec, codec_params=dict(blob.params),
                    chunks=[(s, r) for s, r in blob.chunks], checksum=digest, delta=blob.delta,
                ))  # fmt: skip
            began = time.perf_counter()
            writer.sync()
            stages["fsync"] = time.perf_counter() - began
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()  # the file this call created: never leave a partial data file behind
            raise
        finally:
            writer.close()
    finally:
        snapshot.release()
    return WrittenPart(records=records, codecs=codecs, stage_seconds=stages)


class Committer(Protocol):
    """How the checkpointer's worker turns one save into a committed checkpoint.

    The variants are passed to :class:`~asyncckpt.AsyncCheckpointer` rather than made by
    overriding it: :class:`RunDirectory` (the default: ``step-N`` directories, ``latest``,
    retention), the distributed rank commit (:class:`asyncckpt.distributed._protocol.RankCommitter`)
    and the integrations' explicit paths (:class:`asyncckpt.integrations._targeted.TargetPaths`).
    Each writes its data through :func:`write_part`, commits through
    :func:`asyncckpt._commit.commit_checkpoint` and reports through :func:`job_result`.

    ``persist`` runs on the worker thread, one save at a time, and issues no collectives. It raises
    on failure (the checkpointer reports it and invalidates ``backend.delta``).
    """

    def persist(self, job: SaveJob, backend: Backend, keep_last: int | None) -> SaveResult: ...


@dataclass(frozen=True)
class RunDirectory:
    """Commit each save as ``root/step-NNNNNNNNNN``, point ``latest`` at it, then apply retention."""

    root: Path

    def persist(self, job: SaveJob, backend: Backend, keep_last: int | None) -> SaveResult:
        final = self.root / checkpoint_name(job.step)
        if not self.root.is_dir():  # deleted mid-run: every later save would fail without it
            log.warning("asyncckpt: the run directory %s is gone; recreating it", self.root)
            self.root.mkdir(parents=True, exist_ok=True)
        delta = begin_delta(backend.delta, job, backend.encoder)
        result = persist_to(job, final, backend.encoder, backend.storage, delta=delta)
        retain_quietly(self.root, keep_last, protect=final)
        return result


def begin_delta(delta: DeltaWriter | None, job: SaveJob, encoder: Encoder) -> DeltaSave | None:
    """This save's delta session, or None without the delta option. Worker thread, as it takes the
    save: after the previous save committed or failed, so the session's base is the last commit.

    An encoder that compresses whole snapshots (the GPU pipeline) gets the session through the
    snapshot (:class:`asyncckpt._gpu.snapshot.DeltaHandoff`); its compressor waits for it."""
    if delta is None:
        return None
    session = delta.begin(job.step, full=job.full, staging_bytes=job.snapshot.staging_bytes)
    if encoder.batched:
        handoff = getattr(job.snapshot, "delta", None)
        if handoff is None:  # a snapshot built elsewhere: compressed without deltas
            delta.invalidate()  # nothing recorded this save: the next one cannot refer to it
            return None
        handoff.provide(session)
    return session


def retain_quietly(root: Path, keep_last: int | None, protect: Path) -> None:
    """Apply retention after a commit; a failure here is a warning: the new checkpoint is committed."""
    try:
        apply_retention(root, keep_last, protect=protect)
    except OSError as exc:
        log.warning("asyncckpt: %s is committed, but deleting older checkpoints failed: %s", protect, exc)


def persist_to(job: SaveJob, final: Path, encoder: Encoder, storage: Storage, *, point_latest: bool = True,
               replace: bool = False, delta: DeltaSave | None = None) -> SaveResult:  # fmt: skip
    """Write ``job`` into a temporary directory beside ``final`` and commit it as ``final``. Worker thread.

    ``point_latest`` and ``replace``: as for :func:`asyncckpt._commit.commit_checkpoint` (the
    run-directory layout, or a path an integration chose). ``delta``: this save's incremental
    session (the manifest refers to its base; its bytes become the next reference once committed).
    """
    tmp = temporary_dir(final.parent, job.step)
    try:
        os.mkdir(tmp)
        reached("tmp-created")
        part = write_part(job.snapshot, encoder, storage, tmp / DATA_FILE, delta)
        reached("data-written")
        began = time.perf_counter()
        # The skeleton may be built here, lazily: its failure must not leave the directory either.
        manifest = Manifest(step=job.step, created_unix=job.created_unix, library_version=__version__,
                            tensors=part.records, structure=job.skeleton, metadata=job.metadata,
                            io_mode=storage.io_mode, reference=delta.reference if delta else None)  # fmt: skip
    except BaseException:
        # The snapshot is released by write_part, or by the checkpointer's worker if it failed earlier.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest_bytes = commit_checkpoint(tmp, manifest, final, files=job.files, point_latest=point_latest,
                                       replace=replace)  # fmt: skip
    commit_seconds = time.perf_counter() - began
    if delta is not None:
        delta.committed(job.step, manifest_bytes, manifest.is_delta)
    return job_result(job, final, part, storage.io_mode, commit_seconds)


def job_result(job: SaveJob, final: Path, part: WrittenPart | None, io_mode: str, commit_seconds: float) -> SaveResult:
    """The :class:`SaveResult` of a committed ``job`` whose part (None: this process wrote none) is in ``final``.

    Call it right after the commit: it reads the clock for ``durable_seconds``. Worker thread.
    """
    stages = {"snapshot": job.snapshot_seconds, **(part.stage_seconds if part else {}), "commit": commit_seconds}
    return save_result(job.step, final, part, io_mode, stages=stages, stall_seconds=job.stall_seconds,
                       gpu_idle_seconds=job.stall_seconds + job.snapshot.gpu_busy_seconds(), started=job.started,
                       snapshot_mode=job.snapshot_mode, snapshot_reason=job.snapshot_reason,
                       notes=tuple(job.snapshot.notes))  # fmt: skip


def save_result(step: int, final: Path, part: WrittenPart | None, io_mode: str, *, stages: dict[str, float],
                stall_seconds: float, gpu_idle_seconds: float, started: float, snapshot_mode: str,
                snapshot_reason: str = "", notes: tuple[str, ...] = ()) -> SaveResult:  # fmt: skip
    """The one place a :class:`SaveResult` is assembled: the checkpointers (through :func:`job_result`)
    and the DCP plugin's writer. ``started`` is the ``time.perf_counter()`` the save began at;
    ``durable_seconds`` runs from it to this call. Any thread."""
    records = part.records if part is not None else []
    return SaveResult(
        step=step, path=final, raw_bytes=sum(r.raw_bytes for r in records),
        stored_bytes=sum(r.stored_bytes for r in records), stall_seconds=stall_seconds, stage_seconds=stages,
        io_mode=io_mode, snapshot_mode=snapshot_mode, snapshot_reason=snapshot_reason,
        codecs=dict(part.codecs) if part is not None else {}, durable_seconds=time.perf_counter() - started,
        gpu_idle_seconds=gpu_idle_seconds, notes=notes,
    )  # fmt: skip


def check_extra_files(files: dict[str, bytes] | None) -> dict[str, bytes]:
    """Validate extra file names for :attr:`SaveJob.files` on the training thread; returns a copy."""
    if not files:
        return {}
    out = {}
    for name, data in files.items():
        if not isinstance(name, str) or not _EXTRA_NAME.fullmatch(name) or name == MANIFEST_NAME or \
                name.startswith("data-"):  # fmt: skip
            raise ValueError(f"extra checkpoint file name {name!r} must be a plain file name, not {MANIFEST_NAME} "
                             "or data-*")  # fmt: skip
        out[name] = bytes(data)
    return out
