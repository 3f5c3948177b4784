"""The ways to save a checkpoint that the stall-time benchmark compares, behind one interface.

A :class:`Method` is opened once, then :meth:`Method.save` is called on the training thread
with the live state and returns a :class:`Pending` as soon as the training loop may go on (for
the synchronous methods: once the bytes are durable). ``Pending.finish()`` blocks until the
checkpoint is durable and says where it is, so the benchmark can measure and delete it.

Method names (``--methods``):

* ``torch.save`` — ``torch.save`` to one file, flush, ``fsync``;
* ``dcp.save`` — ``torch.distributed.checkpoint.save`` (``FileSystemWriter``, which fsyncs);
* ``dcp.async_save`` — ``dcp.async_save`` with its default stager (a synchronous copy into
  pageable host memory, then a background thread writes);
* ``dcp.async_save+zstd`` — the same, writing through DCP's ``ZStandard`` stream extension;
* ``dcp.async_save+pinned`` — with ``DefaultStager(use_pinned_memory=True)``, kept across saves;
* ``asyncckpt:<snapshot>:<codec>`` — :class:`asyncckpt.AsyncCheckpointer` with that snapshot
  mode (``host``/``device``/``fence``/``auto``) and codec (``auto``/``zstd``/``none``/``ans``/...);
  ``asyncckpt:<snapshot>:<codec>:delta`` — the same with ``delta="on"`` (incremental checkpoints:
  the first saves are full, later ones deltas against the chain's full save).

DCP needs a process group even in one process; :func:`ensure_process_group` starts a 1-rank
``gloo`` group on a ``FileStore`` (DCP's collectives exchange only plans and metadata, which
gloo carries on the CPU; ``dcp.async_save`` requires a CPU backend anyway).
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

BASELINE = "baseline"
DCP_METHODS = ("dcp.save", "dcp.async_save", "dcp.async_save+zstd", "dcp.async_save+pinned")


class Unavailable(Exception):
    """This method cannot run on this machine or with this torch; the message says why."""


@dataclass
class Finished:
    durable_seconds: float
    """Wall seconds from the save call's entry until the checkpoint was durable."""
    path: Path
    """What the checkpoint occupies on disk (a file or a directory), deleted after measuring."""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Pending:
    """A save that has returned control to the training loop."""

    done: Callable[[], bool]
    finish: Callable[[], Finished]


def _done_now(finished: Finished) -> Pending:
    return Pending(done=lambda: True, finish=lambda: finished)


class Method:
    name: str
    label: str
    kind: str = "sync"
    """``sync`` (training waits until durable) or ``async``."""

    def open(self, scratch: Path) -> None:
        """Prepare to save under ``scratch``; raise :class:`Unavailable` (or any error) if it cannot run."""
        self.directory = scratch / self.name.replace(":", "-").replace("+", "-")
        self.directory.mkdir(parents=True, exist_ok=True)

    def save(self, step: int, state: dict[str, Any]) -> Pending:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the method holds (staging memory, worker threads)."""


class TorchSave(Method):
    name = label = "torch.save"

    def save(self, step: int, state: dict[str, Any]) -> Pending:
        began = time.perf_counter()
        path = self.directory / f"step-{step}.pt"
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        return _done_now(Finished(time.perf_counter() - began, path))


def process_group_store(scratch: Path) -> Path:
    return scratch / f"dcp-store-{os.getpid()}"


def ensure_process_group(scratch: Path) -> bool:
    """Start a 1-rank gloo process group unless one exists; True if this call started it."""
    import torch.distributed as dist

    if not dist.is_available():
        raise Unavailable("torch.distributed is not available in this torch build")
    if dist.is_initialized():
        return False
    store_path = process_group_store(scratch)
    store_path.unlink(missing_ok=True)
    # One rank talks to nobody: keep gloo on the loopback interface, which works without a resolvable hostname.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(str(store_path), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return True


class DcpSave(Method):
    name = label = "dcp.save"

    def open(self, scratch: Path) -> None:
        import torch.distributed.checkpoint  # noqa: F401 - imported here, not inside the first timed save

        super().open(scratch)
        ensure_process_group(scratch)

    def save(self, step: int, state: dict[str, Any]) -> Pending:
        import torch.distributed.checkpoint as dcp

        began = time.perf_counter()
        path = self.directory / f"step-{step}"
        dcp.save(state, checkpoint_id=str(path))
        return _done_now(Finished(time.perf_counter() - began, path))


class DcpAsyncSave(Method):
    """``dcp.async_save``: the stager copies the state on the calling thread, a DCP thread writes it."""

    kind = "async"

    def __init__(self, variant: str) -> None:
        if variant not in ("default", "zstd", "pinned"):
            raise ValueError(f"unknown dcp.async_save variant {variant!r}")
        self.variant = variant
        self.name = "dcp.async_save" + ("" if variant == "default" else f"+{variant}")
        self.label = {"default": "dcp.async_save (default stager)", "zstd": "dcp.async_save + zstd extension",
                      "pinned": "dcp.async_save (pinned stager)"}[variant]  # fmt: skip
        self._stager: Any = None

    def open(self, scratch: Path) -> None:
        import torch.distributed.checkpoint as dcp

        super().open(scratch)
        if not hasattr(dcp, "async_save"):
            raise Unavailable(f"torch {torch.__version__} has no torch.distributed.checkpoint.async_save")
        if self.variant == "zstd":
            try:
                from torch.distributed.checkpoint._extension import ZStandard
            except ImportError as exc:
                raise Unavailable(f"torch {torch.__version__} has no DCP ZStandard extension ({exc})") from exc
            if "_extensions" not in inspect.signature(dcp.FileSystemWriter.__init__).parameters:
                raise Unavailable(f"torch {torch.__version__}: FileSystemWriter takes no _extensions")
            if not ZStandard.is_available():
                raise Unavailable("DCP's ZStandard extension needs the zstandard or pyzstd package")
        if self.variant == "pinned":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(),
                                                        use_shared_memory=False, use_async_staging=False,
                                                        use_non_blocking_copy=False))  # fmt: skip
        ensure_process_group(scratch)

    def save(self, step: int, state: dict[str, Any]) -> Pending:
        import torch.distributed.checkpoint as dcp

        began = time.perf_counter()
        path = self.directory / f"step-{step}"
        kwargs: dict[str, Any] = {}
        if self.variant == "zstd":
            from torch.distributed.checkpoint._extension import ZStandard

            kwargs["storage_writer"] = dcp.FileSystemWriter(str(path), _extensions=[ZStandard()])
        else:
            kwargs["checkpoint_id"] = str(path)
        if self._stager is not None:
            kwargs["async_stager"] = self._stager
        response = dcp.async_save(state, **kwargs)
        future: Any = getattr(response, "upload_completion", response)  # AsyncSaveResponse in newer torch
        finished_at: list[float] = []
        future.add_done_callback(lambda _f: finished_at.append(time.perf_counter()))

        def finish() -> Finished:
            future.result()
            end = finished_at[0] if finished_at else time.perf_counter()
            return Finished(end - began, path)

        return Pending(done=future.done, finish=finish)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def reference_store(checkpointer: Any) -> object:
    """The delta reference store of an :class:`~asyncckpt.AsyncCheckpointer` (None with delta off)."""
    delta = getattr(checkpointer, "_delta", None)
    return None if delta is None else delta.store


def references_settled(checkpointer: Any) -> Callable[[], bool] | None:
    """With delta on the GPU path: whether the reference memory the last save asked for is allocated
    (a background thread allocates it after the commit, while training runs). None otherwise."""
    wait = getattr(reference_store(checkpointer), "wait_prepared", None)
    return None if wait is None else lambda: bool(wait(0))


def reference_bytes(checkpointer: Any) -> dict[str, int]:
    """``reference_device_bytes`` / ``reference_host_bytes``: where the delta references are held
    (only the GPU path's store tells the two apart; empty otherwise)."""
    store = reference_store(checkpointer)
    return {f"reference_{name}": int(getattr(store, name)) for name in ("device_bytes", "host_bytes")
            if hasattr(store, name)}  # fmt: skip


class Asyncckpt(Method):
    """asyncckpt's :class:`~asyncckpt.AsyncCheckpointer` with one snapshot mode and codec."""

    kind = "async"

    def __init__(self, snapshot: str, codec: str, delta: bool = False) -> None:
        self.snapshot, self.codec, self.delta = snapshot, codec, delta
        self.name = f"asyncckpt:{snapshot}:{codec}" + (":delta" if delta else "")
        self.label = f"asyncckpt {snapshot} snapshot, {codec} codec" + (", delta on" if delta else "")
        self._checkpointer: Any = None

    @property
    def checkpointer(self) -> Any:
        """The open :class:`~asyncckpt.AsyncCheckpointer` (None before ``open``)."""
        return self._checkpointer

    def open(self, scratch: Path) -> None:
        from asyncckpt import AsyncCheckpointer

        super().open(scratch)
        # keep_last=1 and max_inflight=1: what a job saving every 30 minutes would configure.
        # With delta on, retention also keeps the full save the last checkpoint was taken against.
        self._checkpointer = AsyncCheckpointer(self.directory, snapshot=self.snapshot, codec=self.codec, keep_last=1,
                                               max_inflight=1, delta="on" if self.delta else "off")  # fmt: skip

    def settled(self) -> Callable[[], bool] | None:
        """:func:`references_settled` of this method's checkpointer."""
        return references_settled(self._checkpointer)

    def save(self, step: int, state: dict[str, Any]) -> Pending:
        handle = self._checkpointer.save(step, state)

        def finish() -> Finished:
            result = handle.result()
            details = {"library_stall_seconds": result.stall_seconds, "gpu_idle_seconds": result.gpu_idle_seconds,
                       "snapshot_mode": result.snapshot_mode, "snapshot_reason": result.snapshot_reason,
                       "io_mode": result.io_mode, "codecs": dict(result.codecs),
                       "stage_seconds": dict(result.stage_seconds)}  # fmt: skip
            # Not "raw_bytes": the stall benchmark spreads these details over its own sample's fields.
            details.update(result_raw_bytes=result.raw_bytes, **reference_bytes(self._checkpointer))
            history = getattr(self._checkpointer._backend.encoder, "history", None)  # the GPU compressor's
            if history:
                stats = history[-1]
                details.update(gate_seconds=stats.gate_seconds, spilled_bytes=stats.spilled_bytes,
                               compress_notes=list(stats.notes), specs=dict(stats.specs))  # fmt: skip
            return Finished(result.durable_seconds, Path(result.path), details)

        return Pending(done=handle.done, finish=finish)

    def close(self) -> None:
        if self._checkpointer is not None:
            checkpointer, self._checkpointer = self._checkpointer, None
            checkpointer.close()


def build_method(name: str) -> Method:
    """The method a ``--methods`` entry names."""
    if name == "torch.save":
        return TorchSave()
    if name == "dcp.save":
        return DcpSave()
    if name.startswith("dcp.async_save"):
        variant = name.partition("+")[2] or "default"
        return DcpAsyncSave(variant)
    if name.startswith("asyncckpt:"):
        parts = name.split(":")
        if len(parts) not in (3, 4) or parts[3:] not in ([], ["delta"]):
            raise ValueError(f"asyncckpt methods are asyncckpt:<snapshot>:<codec>[:delta], got {name!r}")
        return Asyncckpt(parts[1], parts[2], delta=len(parts) == 4)
    raise ValueError(f"unknown method {name!r}; see --help")


def default_methods(cuda: bool) -> list[str]:
    """Every method that applies here, most informative first (later ones are dropped first when time runs out)."""
    # device before fence: if a fence ever deadlocked the training step, the copy mode's figures are already saved.
    ours = ["asyncckpt:device:auto", "asyncckpt:fence:auto", "asyncckpt:host:auto"] if cuda else \
        ["asyncckpt:host:auto", "asyncckpt:host:none"]  # fmt: skip
    return [BASELINE, *ours, "torch.save", "dcp.save", "dcp.async_save", "dcp.async_save+zstd"]
