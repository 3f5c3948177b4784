"""A ``torch.distributed.checkpoint`` (DCP) storage plugin: asyncckpt's codecs, checksums and commit under DCP.

Use it wherever DCP takes a storage writer/reader (FSDP2, torchtitan, plain ``dcp.save``)::

    import torch.distributed.checkpoint as dcp
    from asyncckpt.integrations.dcp import AsyncCkptReader, AsyncCkptStager, AsyncCkptWriter

    stager = AsyncCkptStager()                     # host staging; snapshot="device" stages on the GPU
    future = dcp.async_save(state, storage_writer=AsyncCkptWriter("ckpt/step-100"), async_stager=stager)
    ...
    dcp.load(state, storage_reader=AsyncCkptReader("ckpt/step-100"))   # any number of ranks: DCP reshards

DCP does the planning (which rank writes which chunk, resharding on load); asyncckpt does the
bytes: each rank compresses its chunks (zstd on CPU; nvCOMP with ``codec=`` an nvCOMP name on a
GPU machine), writes them to its own ``data-r{rank}.bin`` with a checksum per chunk and fsyncs
it. The coordinator (rank 0) then writes one format-v1 ``manifest.json`` (DCP's metadata as JSON,
:mod:`._dcp_metadata`) and renames the whole directory into place, so a DCP checkpoint is never
visible half-written, and ``asyncckpt verify`` / ``asyncckpt inspect`` work on it.

No pickle for anything asyncckpt writes. DCP's planner itself ``torch.save``-s non-tensor values
(``BYTE_IO`` items) and its default load planner reads them with ``torch.load(weights_only=False)``;
the reader therefore checks each such payload with ``torch.load(weights_only=True)`` first and
refuses one that would run code (``allow_unsafe_bytes=True`` turns the check off for trusted files).

Threads: the writer and reader run on whatever thread DCP calls them from (the caller's for
``dcp.save``/``dcp.load``, DCP's save thread for ``async_save``); the stager's ``stage`` runs on the
training thread. The only collectives are DCP's own, issued by DCP; with ``async_save`` they run on
DCP's save thread, so pass ``process_group=`` a separate gloo group there (see docs/distributed.md).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .._backend import build_backend
from .._checkpointer import _default_observer
from .._commit import commit_checkpoint
from .._loader import load_tensors
from .._manifest import MANIFEST_NAME, Manifest, TensorRecord, read_manifest
from .._persist import save_result, write_part
from .._snapshot import StagedTensor, bytes_view
from .._tree import FlatState, TensorLeaf
from .._version import __version__
from .._walker import map_state
from ..errors import CheckpointError, CorruptCheckpointError
from ..observer import GuardedObserver, NullObserver, SaveObserver, notify_load_finished
from ..options import resolve_options
from ..result import SaveResult
from . import _staging
from ._dcp_metadata import DCP_KEY, decode_metadata, encode_metadata

__all__ = ["AsyncCkptReader", "AsyncCkptStager", "AsyncCkptWriter"]

DCP_VERSION = "1.0.0"
"""The DCP metadata version this writer produces (that of torch's FileSystemWriter)."""

_READ_BATCH_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class _PlanData:
    """What the coordinator tells each rank in its plan: where to write."""

    tmp_name: str
    rank: int


@dataclasses.dataclass(frozen=True)
class _StoredItem:
    """What a rank reports for one written chunk (DCP gathers these to the coordinator)."""

    kind: str
    record: TensorRecord


def _data_file(rank: int) -> str:
    return f"data-r{rank}.bin"


def _item_key(index: MetadataIndex) -> str:
    return index.fqn if index.offset is None else f"{index.fqn}@{','.join(map(str, index.offset))}"


def _step_of(path: Path) -> int:
    found = re.search(r"(\d+)$", path.name)
    return int(found.group(1)) if found else 0


class AsyncCkptWriter(StorageWriter):
    """DCP ``StorageWriter``: per-rank compressed, checksummed data files; atomic commit by the coordinator.

    Args:
        path: the checkpoint directory (DCP's ``checkpoint_id``); ``dcp.save(checkpoint_id=...)``
            may change it per save. All ranks must see the same directory (shared file system).
        overwrite: replace an existing checkpoint at ``path`` (old one renamed aside, then deleted).
        observer, registry: metrics, as for :class:`~asyncckpt.AsyncCheckpointer`. The coordinator
            reports a save when it commits; other ranks when their part is durable.
        **options: :class:`~asyncckpt.CheckpointOptions` fields that pick the data path: ``codec``
            (``auto``/``zstd``/``none`` on CPU, an nvCOMP name for the GPU path), ``zstd_level``, ...

    One writer serves one save at a time: with ``dcp.async_save``, wait for the previous
    future before the next save, as DCP's own ``FileSystemWriter`` requires.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, overwrite: bool = True,
                 observer: SaveObserver | None = None, registry: Any = None, **options: Any) -> None:  # fmt: skip
        super().__init__()
        self.options = resolve_options(**options)
        if self.options.delta != "off":
            raise CheckpointError(
                f"AsyncCkptWriter does not write incremental checkpoints (delta={self.options.delta!r}, perhaps "
                "from ASYNCCKPT_DELTA): DCP reshards on load, so a per-rank delta would be meaningless; use delta='off'"
            )
        self.path = Path(path) if path is not None else None
        self.overwrite = overwrite
        # Guarded: a hook that raises is logged and counted, and never fails a write that succeeded.
        self.observer = GuardedObserver(observer if observer is not None else _default_observer(self.options, registry))
        self._backend = build_backend(self.options)
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self._pending: tuple[SaveResult, float] | None = None  # (result, perf_counter at write start)

    # -- DCP's StorageWriter interface, in the order DCP calls it ---------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._pending = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise CheckpointError("AsyncCkptWriter needs DCP's collectives (use_collectives=True): the coordinator "
                                  "commits every rank's part in one manifest")  # fmt: skip
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: create the save's temporary directory and tell each rank its file."""
        final = self._final()
        final.parent.mkdir(parents=True, exist_ok=True)
        if final.exists() and not self.overwrite:
            raise CheckpointError(f"{final}: a checkpoint exists and overwrite=False")
        # Leftovers of earlier failed saves to this same checkpoint id (one save per id at a time).
        for stale in final.parent.glob(f".tmp-dcp-{final.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp_name = f".tmp-dcp-{final.name}-{self.save_id[:12]}"
        (final.parent / tmp_name).mkdir()
        return [dataclasses.replace(plan, storage_data=_PlanData(tmp_name, rank)) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Compress and write this rank's chunks to ``data-r{rank}.bin`` and fsync it (DCP's thread)."""
        started = time.perf_counter()
        where: _PlanData = plan.storage_data
        path = self._final().parent / where.tmp_name / _data_file(where.rank)
        claimed = _staging.claim(_planner_tensors(planner))
        snapshot = _PlanSnapshot(plan.items, planner, claimed, host_only=self._backend.snapshot_mode == "host")
        try:
            part = write_part(snapshot, self._backend.encoder, self._backend.storage, path)
        except BaseException as exc:  # write_part released the snapshot and removed the partial file
            self.observer.save_failed(exc, 0)
            raise
        results = [
            WriteResult(index=item.index, size_in_bytes=record.stored_bytes,
                        storage_data=_StoredItem("bytes" if item.type == WriteItemType.BYTE_IO else "tensor", record))
            for item, record in zip(plan.items, part.records, strict=True)
        ]  # fmt: skip
        stall = sum(e.stall_seconds for e in claimed)
        result = save_result(_step_of(self._final()), self._final(), part, self._backend.storage.io_mode,
                             stages=dict(part.stage_seconds), stall_seconds=stall, gpu_idle_seconds=stall,
                             started=started, snapshot_mode=self._backend.snapshot_mode,
                             snapshot_reason=self._backend.snapshot_reason, notes=tuple(snapshot.notes))  # fmt: skip
        if self.is_coordinator:
            self._pending = (result, started)  # reported once the commit is done (or failed), in finish()
        else:
            self.observer.save_finished(result, 0)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: write the manifest for every rank's chunks and rename the directory into place."""
        began = time.perf_counter()
        final = self._final()
        tmp = final.parent / f".tmp-dcp-{final.name}-{self.save_id[:12]}"
        try:
            records: list[TensorRecord] = []
            items: list[tuple[MetadataIndex, str, int]] = []
            for rank_results in results:
                for wr in rank_results:
                    stored: _StoredItem = wr.storage_data
                    items.append((wr.index, stored.kind, len(records)))
                    records.append(stored.record)
            metadata.version = DCP_VERSION
            metadata.storage_meta = self.storage_meta()
            structure = {"t": "dict", "items": [[{"t": "str", "v": _item_key(index)}, {"t": "tensor", "id": i}]
                                                for index, _, i in items]}  # fmt: skip
            manifest = Manifest(step=_step_of(final), created_unix=time.time(), library_version=__version__,
                                tensors=records, structure=structure,
                                metadata={DCP_KEY: encode_metadata(metadata, items), "world_size": len(results)},
                                io_mode=self._backend.storage.io_mode)  # fmt: skip
            commit_checkpoint(tmp, manifest, final, point_latest=False, replace=self.overwrite)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)  # also when the plan was refused before the commit step
            self.observer.save_failed(exc, 0)
            raise
        if self._pending is not None:
            (pending, started), self._pending = self._pending, None
            now = time.perf_counter()  # durable once committed: the coordinator's time includes the commit
            stages = {**pending.stage_seconds, "commit": now - began}
            self.observer.save_finished(
                dataclasses.replace(pending, stage_seconds=stages, durable_seconds=now - started), 0
            )

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.path) if self.path is not None else None, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return "://" not in str(checkpoint_id)

    @property
    def checkpoint_id(self) -> str | None:
        return None if self.path is None else str(self.path)

    def close(self) -> None:
        """Stop the codec's threads. The writer cannot save afterwards."""
        self._backend.close()

    def _final(self) -> Path:
        if self.path is None:
            raise CheckpointError("no checkpoint path: pass one to AsyncCkptWriter(path) or checkpoint_id= to dcp.save")
        return self.path


def _planner_tensors(planner: SavePlanner) -> Iterator[torch.Tensor]:
    """The tensors of the state dict DCP is saving (the default planner keeps it as ``state_dict``)."""
    state = getattr(planner, "state_dict", None)
    if isinstance(state, dict):
        for value in state.values():
            tensor = _staging.local_tensor(value)
            if tensor is not None:
                yield tensor


class _PlanSnapshot:
    """A :class:`~asyncckpt._snapshot.Snapshot` over a DCP plan: items resolved one at a time, as
    ``write_part`` reaches them (DCP asks writers to resolve lazily: resolving may allocate)."""

    def __init__(self, items: Sequence[WriteItem], planner: SavePlanner, claimed: list[_staging.StagedSave],
                 host_only: bool) -> None:  # fmt: skip
        self._items, self._planner, self._claimed, self._host_only = items, planner, claimed, host_only
        self._live_synced: set[torch.device] = set()

    @property
    def tensors(self) -> Sequence[StagedTensor]:
        return _LazyItems(self)

    @property
    def staging_bytes(self) -> int:
        return 0

    def wait_ready(self) -> None:
        for entry in self._claimed:
            entry.snapshot.wait_ready()

    def release(self) -> None:
        for entry in self._claimed:
            entry.release()

    def gpu_busy_seconds(self) -> float:
        return sum(e.snapshot.gpu_busy_seconds() for e in self._claimed)

    @property
    def notes(self) -> list[str]:
        return [note for e in self._claimed for note in e.snapshot.notes]

    @property
    def stable(self) -> bool:
        return all(e.snapshot.stable for e in self._claimed)

    def when_staged(self, callback: Callable[[], None]) -> None:
        callback()  # DCP reports staging itself, through its stager; nothing waits on this

    def resolve(self, item: WriteItem) -> StagedTensor:
        data = self._planner.resolve_data(item)
        key = _item_key(item.index)
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            raw = torch.frombuffer(bytearray(data.getbuffer()), dtype=torch.uint8) if data.getbuffer().nbytes else \
                torch.empty(0, dtype=torch.uint8)  # fmt: skip
            return StagedTensor(key=key, dtype=torch.uint8, shape=(raw.numel(),), device=torch.device("cpu"), data=raw)
        assert isinstance(data, torch.Tensor)
        tensor = data.detach()
        late = _staging.claim([tensor])  # a custom planner's tensors that were not in planner.state_dict
        for entry in late:
            entry.snapshot.wait_ready()
        self._claimed.extend(late)
        device = tensor.device
        if tensor.is_cuda and self._host_only:
            tensor = tensor.cpu()  # a CPU codec: bring the chunk to the host (this thread waits for the copy)
        # "Only the projection needs to be saved": a view is saved as its own bytes, contiguous.
        tensor = self._final_on_device(tensor) if tensor.is_cuda else tensor.contiguous()
        return StagedTensor(key=key, dtype=tensor.dtype, shape=tuple(tensor.shape), device=device,
                            data=bytes_view(tensor))  # fmt: skip

    def _final_on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` contiguous, with its bytes final: the GPU encoder and the writers read them
        from their own streams, ordered after nothing (the BlobWriter contract).

        A tensor of a claimed asyncckpt snapshot is final once that snapshot is ready. Any other
        is a live tensor (plain ``dcp.save``, or a stager that kept CUDA tensors) whose last
        writes may still be queued on some stream of the caller's: the first such tensor waits
        for all of its device's work, on this (DCP's) thread. A contiguous copy is made on this
        thread's current stream and waited for.
        """
        key = _staging.storage_key(tensor) if tensor.numel() else None
        live = key is not None and not any(key in entry.storages for entry in self._claimed)
        if live and tensor.device not in self._live_synced:
            torch.cuda.synchronize(tensor.device)
            self._live_synced.add(tensor.device)
        if tensor.is_contiguous():
            return tensor
        copy = tensor.contiguous()
        torch.cuda.current_stream(tensor.device).synchronize()
        return copy


class _LazyItems(Sequence[StagedTensor]):
    def __init__(self, owner: _PlanSnapshot) -> None:
        self._owner = owner

    def __len__(self) -> int:
        return len(self._owner._items)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._owner.resolve(item) for item in self._owner._items[index]]
        return self._owner.resolve(self._owner._items[index])

    def __iter__(self) -> Iterator[StagedTensor]:
        for item in self._owner._items:
            yield self._owner.resolve(item)


class AsyncCkptReader(StorageReader):
    """DCP ``StorageReader`` for checkpoints written by :class:`AsyncCkptWriter`; verifies every checksum.

    Loads on any number of ranks (DCP's planner reshards: each rank reads just the chunks that
    overlap its shards). Runs on the thread that called ``dcp.load``.

    Args:
        path: the checkpoint directory (or pass ``checkpoint_id=`` to ``dcp.load``).
        allow_unsafe_bytes: skip the ``weights_only`` check of non-tensor values (trusted files only).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, allow_unsafe_bytes: bool = False) -> None:
        super().__init__()
        self.path = Path(path) if path is not None else None
        self.allow_unsafe_bytes = allow_unsafe_bytes
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, _StoredItem] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._path()
        manifest = read_manifest(path)
        if DCP_KEY not in manifest.metadata:
            raise CheckpointError(f"{path}: an asyncckpt checkpoint, but not one written through DCP; "
                                  "load it with asyncckpt.load()")  # fmt: skip
        metadata, items = decode_metadata(manifest.metadata[DCP_KEY], len(manifest.tensors), str(path))
        metadata.storage_data = {index: _StoredItem(kind, manifest.tensors[i]) for index, kind, i in items}
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CheckpointError("DCP metadata without storage data: not read by AsyncCkptReader.read_metadata")
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read, verify and decode the chunks this rank's plan needs, and hand them to the planner."""
        began = time.perf_counter()
        path = self._path()
        by_record: dict[int, list[Any]] = {}
        stored_of: dict[int, _StoredItem] = {}
        for req in plan.items:
            stored = self.storage_data.get(req.storage_index)
            if stored is None:
                raise CorruptCheckpointError(f"{path}: the checkpoint has no chunk {req.storage_index}")
            by_record.setdefault(id(stored), []).append(req)
            stored_of[id(stored)] = stored
        # Decode in batches of bounded size, in file order, so memory stays near one batch.
        order = sorted(stored_of, key=lambda k: (stored_of[k].record.file, stored_of[k].record.offset))
        for batch in _batches(order, lambda k: stored_of[k].record.raw_bytes):
            part = Manifest(step=0, created_unix=0.0, library_version=__version__,
                            tensors=[stored_of[k].record for k in batch], structure={})  # fmt: skip
            for key, tensor in zip(batch, load_tensors(path, part, "cpu"), strict=True):
                for req in by_record[key]:
                    self._deliver(req, stored_of[key], tensor, planner, path)
        notify_load_finished(time.perf_counter() - began)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _deliver(self, req: Any, stored: _StoredItem, tensor: torch.Tensor, planner: LoadPlanner, path: Path) -> None:
        if req.type == LoadItemType.BYTE_IO:
            data = tensor.numpy().tobytes()
            if not self.allow_unsafe_bytes:
                _check_safe_pickle(data, f"{path}: value {req.storage_index.fqn!r}")
            planner.load_bytes(req, io.BytesIO(data))
            return
        if stored.kind != "tensor":
            raise CorruptCheckpointError(f"{path}: {req.storage_index.fqn!r} is stored as bytes, requested as a tensor")
        piece = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != piece.size():
            raise CorruptCheckpointError(f"{path}: chunk {req.storage_index} has size {tuple(piece.size())}, "
                                         f"the plan expects {tuple(target.size())}")  # fmt: skip
        target.copy_(piece)
        planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return (Path(checkpoint_id) / MANIFEST_NAME).is_file()

    @property
    def checkpoint_id(self) -> str | None:
        return None if self.path is None else str(self.path)

    def _path(self) -> Path:
        if self.path is None:
            raise CheckpointError("no checkpoint path: pass one to AsyncCkptReader(path) or checkpoint_id= to dcp.load")
        return self.path


def _batches(keys: list[int], size_of: Any) -> Iterator[list[int]]:
    batch: list[int] = []
    total = 0
    for key in keys:
        if batch and total + size_of(key) > _READ_BATCH_BYTES:
            yield batch
            batch, total = [], 0
        batch.append(key)
        total += size_of(key)
    if batch:
        yield batch


def _check_safe_pickle(data: bytes, where: str) -> None:
    """Refuse a ``torch.save`` payload that the ``weights_only`` unpickler rejects (it could run code)."""
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{where}: the stored value is not loadable with torch.load(weights_only=True) ({type(exc).__name__}: "
            f"{exc!s:.200}); refusing to unpickle it. If you trust this checkpoint, pass "
            "AsyncCkptReader(..., allow_unsafe_bytes=True)"
        ) from exc


class AsyncCkptStager(AsyncStager):
    """DCP ``AsyncStager``: snapshot the state dict with asyncckpt's stagers before ``async_save`` returns.

    ``snapshot="host"`` (the default on CPU) copies every tensor into a reusable host arena
    (pinned when CUDA is present; the copies from the GPU are queued on the current stream and
    awaited by the writer, not by the training thread). ``snapshot="device"`` copies into a GPU
    arena through :mod:`asyncckpt._gpu` (D2D at memory bandwidth), for an :class:`AsyncCkptWriter`
    with an nvCOMP codec. Either way the state may be mutated as soon as ``async_save`` returns.

    At most ``max_inflight`` snapshots exist at once: ``stage`` waits for the oldest save to
    release its arena (its data is durable) up to ``staging_timeout_seconds``, then fails with
    an error that says so. Non-tensor values are deep-copied (DCP pickles them later, on its
    save thread). Runs on the training thread.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, *, snapshot: str = "auto", max_inflight: int = 1, staging_timeout_seconds: float = 600.0,
                 observer: SaveObserver | None = None, registry: Any = None, **options: Any) -> None:  # fmt: skip
        if snapshot == "fence":
            raise CheckpointError(
                "AsyncCkptStager cannot fence: DCP hands the staged state dict to its own save thread, which would "
                "read the live tensors while training mutates them. Use snapshot='device' (GPU arena) or 'host'"
            )
        # The stager only stages: its backend's encoder is never used for the data (the writer's is).
        self.options = resolve_options(snapshot=snapshot, max_inflight=max_inflight, codec="none", **options)
        self._backend = build_backend(self.options)
        self.observer = observer if observer is not None else (
            _default_observer(self.options, registry) if registry is not None else NullObserver())  # fmt: skip
        self.staging_timeout_seconds = staging_timeout_seconds
        self._slots = threading.BoundedSemaphore(self.options.max_inflight)
        self._inflight = 0
        self._lock = threading.Lock()

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        if not self._slots.acquire(timeout=self.staging_timeout_seconds):
            raise CheckpointError(
                f"no staging slot freed within {self.staging_timeout_seconds:g} s: max_inflight="
                f"{self.options.max_inflight} saves still hold staging memory. Wait for the previous async_save's "
                "future (or raise max_inflight); a save that failed releases its slot once its state dict is freed"
            )
        try:
            leaves: list[TensorLeaf] = []
            collected = _collect(state_dict, leaves)
            snapshot = self._backend.stager.stage(FlatState(skeleton={}, tensors=leaves))
        except BaseException:
            self._slots.release()
            raise
        views = [_typed_view(staged) for staged in snapshot.tensors]
        staged_dict = _StagedDict(_rebuild(collected, views))
        stall = time.perf_counter() - started
        with self._lock:
            self._inflight += 1
            inflight = self._inflight
        _staging.register(snapshot, stall, self._released, owner=staged_dict)
        self.observer.save_staged(stall, snapshot.staging_bytes, inflight)
        return staged_dict

    def _released(self) -> None:
        with self._lock:
            self._inflight -= 1
        self._slots.release()

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns a snapshot that is already safe from mutation."""

    def close(self) -> None:
        self._backend.close()


class _StagedDict(dict[str, Any]):
    """A plain dict that can be weakly referenced (so an unclaimed snapshot is freed with it)."""


class _Leaf:
    """Where a tensor stood in the state dict: its index among the staged tensors, and the tensor."""

    def __init__(self, index: int, original: torch.Tensor) -> None:
        self.index, self.original = index, original


def _collect(state_dict: dict[str, Any], leaves: list[TensorLeaf]) -> Any:
    """The state dict with a :class:`_Leaf` for each tensor, whose memory (a DTensor's local shard) joins ``leaves``.

    Every other value is deep-copied: DCP pickles it later, on its save thread. Each occurrence
    of a tensor is its own leaf (DCP plans one write item per key). Training thread.
    """

    def collect(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            local = _staging.local_tensor(value)
            assert local is not None
            leaves.append(TensorLeaf(key=where or "<root>", tensor=local.detach()))
            return _Leaf(len(leaves) - 1, value)
        return copy.deepcopy(value)

    return map_state(state_dict, collect)


def _rebuild(collected: Any, views: list[torch.Tensor]) -> Any:
    """The collected state dict with each :class:`_Leaf` replaced by its staged view (a DTensor again if it was one)."""

    def rebuild(value: Any, where: str) -> Any:
        if not isinstance(value, _Leaf):
            return value
        view = views[value.index]
        spec = getattr(value.original, "_spec", None)
        if spec is not None:  # a DTensor: same mesh and placements, its local shard staged
            from torch.distributed.tensor import DTensor

            return DTensor(view, spec, requires_grad=False)
        return view

    return map_state(collected, rebuild)


def _typed_view(staged: StagedTensor) -> torch.Tensor:
    if staged.data.numel() == 0:
        return torch.empty(staged.shape, dtype=staged.dtype, device=staged.data.device)
    return staged.data.view(staged.dtype).view(staged.shape)
