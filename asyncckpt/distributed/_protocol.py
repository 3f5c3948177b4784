"""The commit protocol of a distributed save, coordinated through the shared checkpoint directory.

Every rank's worker thread runs :meth:`RankCommitter.persist` for the same step, in any order and at any
speed. Nothing here talks to a process group: the ranks see each other only through files in
the run directory, which all ranks must share (the same requirement as
``torch.distributed.checkpoint.FileSystemWriter``)::

    runs/exp1/
      .tmp-step-0000000500-dist-<session>/   the save in progress (one per step and job)
        data-r0.bin  data-r1.bin             each rank's blobs (written, fsynced)
        part-r0.json part-r1.json            each rank's part: a format-v1 manifest of its own
                                             tensors, renamed into place once its data is durable
        failed-r1.json                       a rank whose write failed says so and why
      .abort-step-0000000500-<session>       the committer gave up: why, and which ranks
      step-0000000500/                       committed: manifest.json (all ranks) + data-r*.bin

Rank 0 is the committer: once every rank's ``part-r*.json`` exists it writes the combined
``manifest.json`` and renames the directory (the same atomic commit as a single-process save),
then points ``latest`` at it. If a rank reports failure, or does not report within
``commit_timeout_seconds``, rank 0 writes the abort marker and no rank's save succeeds; every
other rank waits for the commit or the marker, and gives up with a clear error if rank 0 itself
never answers. Either way the previous checkpoint stays the latest: ``latest`` only ever moves
forward to a complete directory.

``<session>`` is agreed once, at construction (see :mod:`asyncckpt.distributed._group`), so a
restarted job never mistakes a dead incarnation's leftovers for its own ranks' parts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._codecs import Encoder
from .._commit import commit_checkpoint, finish_interrupted_commit
from .._commit_points import reached
from .._data_path import Backend
from .._delta_encode import DeltaSave
from .._files import fsync_dir, write_durably
from .._layout import checkpoint_name, is_commit_marker, pointer_reaches
from .._manifest import MANIFEST_NAME, Manifest, Reference, TensorRecord, manifest_json, parse_manifest, read_manifest
from .._persist import SaveJob, WrittenPart, begin_delta, job_result, retain_quietly, write_part
from .._storage import Storage
from .._version import __version__
from ..errors import CheckpointError
from ..result import SaveResult

log = logging.getLogger("asyncckpt")

DISTRIBUTED_KEY = "distributed"
"""Key of the distributed section in a committed manifest's ``metadata``."""


class RankFailedError(CheckpointError):
    """A distributed save failed on some rank (or a rank never answered); no rank committed it."""


@dataclass(frozen=True)
class RankContext:
    """Who this process is in a distributed save, and how long it waits for the others."""

    rank: int
    world_size: int
    session: str
    writers: tuple[int, ...]
    """Ranks that write a part: every rank, or only rank 0 for a replicated state."""
    commit_timeout_seconds: float
    poll_seconds: float = 0.25
    """Longest pause between two looks at the directory (polls start at 5 ms and back off)."""


def data_file_name(rank: int) -> str:
    return f"data-r{rank}.bin"


def part_file_name(rank: int) -> str:
    return f"part-r{rank}.json"


def temporary_dir(root: Path, step: int, session: str) -> Path:
    return root / f".tmp-{checkpoint_name(step)}-dist-{session}"


def abort_marker(root: Path, step: int, session: str) -> Path:
    return root / f".abort-{checkpoint_name(step)}-{session}"


@dataclass(frozen=True)
class RankCommitter:
    """The :class:`~asyncckpt._persist.Committer` of a distributed checkpointer: this rank's part of
    each save under ``root``, committed by rank 0 once every writer's part is durable."""

    root: Path
    ctx: RankContext

    def persist(self, job: SaveJob, backend: Backend, keep_last: int | None) -> SaveResult:
        """Write this rank's part of ``job`` and take part in the commit. Checkpoint worker thread.

        No collectives: coordination is by files only (module docstring). Raises
        :class:`RankFailedError` on every rank when any rank fails or times out. With the delta
        option each rank's records refer to its own records of the previous committed step; the
        checkpointer invalidates ``backend.delta`` if this raises, which every rank sees for a failed save.
        """
        root, ctx = self.root, self.ctx
        tmp = temporary_dir(root, job.step, ctx.session)
        part: WrittenPart | None = None
        session = begin_delta(backend.delta, job, backend.encoder) if ctx.rank in ctx.writers else None
        try:
            if ctx.rank in ctx.writers:
                part = _write_own_part(job, root, tmp, backend.encoder, backend.storage, ctx, session)
            else:
                job.snapshot.release()  # a replica rank stages nothing and writes nothing
        except BaseException as exc:
            _report_failure(root, tmp, job.step, ctx, f"{type(exc).__name__}: {exc}")
            raise
        began = time.perf_counter()
        if ctx.rank == 0:
            final = _commit_as_rank0(job, root, tmp, backend.storage, ctx)
            retain_quietly(root, keep_last, protect=final)  # committed: cleanup problems are warnings
            with contextlib.suppress(OSError):
                _sweep_aborted(root, ctx.session)
        else:
            final = _wait_for_commit(root, job.step, ctx)
        if session is not None:
            # As this rank sees the commit: the combined manifest, whose digest the next save refers to.
            manifest = read_manifest(final)
            session.committed(job.step, manifest.digest, manifest.is_delta)
        return job_result(job, final, part, backend.storage.io_mode, time.perf_counter() - began)


def _write_own_part(job: SaveJob, root: Path, tmp: Path, encoder: Encoder, storage: Storage,
                    ctx: RankContext, delta: DeltaSave | None = None) -> WrittenPart:  # fmt: skip
    marker = abort_marker(root, job.step, ctx.session)
    if marker.exists():  # the committer already gave up on this step: do not write into it
        raise RankFailedError(f"step {job.step} was aborted before rank {ctx.rank} wrote: {_reason(marker)}")
    root.mkdir(parents=True, exist_ok=True)  # deleted mid-run: recreate it, as a single-process save does
    tmp.mkdir(exist_ok=True)  # every rank races to create it; all get the same directory
    data_path = tmp / data_file_name(ctx.rank)
    part = write_part(job.snapshot, encoder, storage, data_path, delta)  # releases the snapshot; cleans up on failure
    reached("data-written")
    own = Manifest(step=job.step, created_unix=job.created_unix, library_version=__version__, tensors=part.records,
                   structure=job.skeleton, metadata={"rank": ctx.rank, "session": ctx.session, "user": job.metadata},
                   io_mode=storage.io_mode, reference=delta.reference if delta else None)  # fmt: skip
    # Written under a scratch name and renamed: part-r{rank}.json appears only complete, and only
    # after its data file is durable, so its existence is this rank's "my part is durable" vote.
    scratch = tmp / f".{part_file_name(ctx.rank)}.writing"
    with contextlib.suppress(FileNotFoundError):
        scratch.unlink()
    write_durably(scratch, manifest_json(own, tmp))
    os.rename(scratch, tmp / part_file_name(ctx.rank))
    fsync_dir(tmp)
    return part


def _report_failure(root: Path, tmp: Path, step: int, ctx: RankContext, reason: str) -> None:
    """Best effort: tell the committer (or, on rank 0, every rank) that this save cannot commit."""
    with contextlib.suppress(OSError):
        if ctx.rank == 0:
            _abort(root, tmp, step, ctx, f"rank 0 failed: {reason}")
        else:
            tmp.mkdir(exist_ok=True)
            write_durably(tmp / f"failed-r{ctx.rank}.json", json.dumps({"rank": ctx.rank, "reason": reason}).encode())


def _abort(root: Path, tmp: Path, step: int, ctx: RankContext, reason: str) -> None:
    marker = abort_marker(root, step, ctx.session)
    scratch = root / f".{marker.name}.writing"
    with contextlib.suppress(FileNotFoundError):
        scratch.unlink()
    write_durably(scratch, json.dumps({"step": step, "reason": reason}).encode())
    os.replace(scratch, marker)
    fsync_dir(root)
    shutil.rmtree(tmp, ignore_errors=True)


def _reason(marker: Path) -> str:
    try:
        return str(json.loads(marker.read_bytes())["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return "(no reason recorded)"


def _backoff(ctx: RankContext) -> Any:
    pause = 0.005
    while True:
        yield pause
        pause = min(ctx.poll_seconds, pause * 2)


def _commit_as_rank0(job: SaveJob, root: Path, tmp: Path, storage: Storage, ctx: RankContext) -> Path:
    deadline = time.monotonic() + ctx.commit_timeout_seconds
    waiting = set(ctx.writers)
    pauses = _backoff(ctx)
    while waiting:
        for rank in sorted(waiting):
            failed = tmp / f"failed-r{rank}.json"
            if failed.exists():
                reason = _reason(failed)
                _abort(root, tmp, job.step, ctx, f"rank {rank} failed: {reason}")
                raise RankFailedError(f"step {job.step} not committed: rank {rank} failed: {reason}")
            if (tmp / part_file_name(rank)).exists():
                waiting.discard(rank)
        if not waiting:
            break
        if time.monotonic() > deadline:
            reason = (f"ranks {sorted(waiting)} did not report their part within {ctx.commit_timeout_seconds:g} s "
                      "(dead, hung, or not calling save() for this step)")  # fmt: skip
            _abort(root, tmp, job.step, ctx, reason)
            raise RankFailedError(f"step {job.step} not committed: {reason}")
        time.sleep(next(pauses))
    try:
        final = root / checkpoint_name(job.step)
        manifest = _combined_manifest(job, tmp, ctx, storage)
        for rank in ctx.writers:
            (tmp / part_file_name(rank)).unlink()
        commit_checkpoint(tmp, manifest, final)
    except BaseException as exc:
        _abort(root, tmp, job.step, ctx, f"rank 0 could not commit: {type(exc).__name__}: {exc}")
        raise
    return final


def _combined_manifest(job: SaveJob, tmp: Path, ctx: RankContext, storage: Storage) -> Manifest:
    """One format-v1 manifest for all ranks: the tensor table is every part's table in rank order,
    and the structure is ``{rank: that rank's state}`` with tensor ids shifted to match."""
    tensors: list[TensorRecord] = []
    items, ranks = [], []
    references: set[Reference] = set()
    for rank in ctx.writers:
        where = str(tmp / part_file_name(rank))
        part = parse_manifest((tmp / part_file_name(rank)).read_bytes(), where)
        if part.metadata.get("session") != ctx.session or part.step != job.step:
            raise RankFailedError(f"{where}: belongs to another job or step; refusing to commit it")
        if any(r.file != data_file_name(rank) for r in part.tensors):
            raise RankFailedError(f"{where}: names a data file other than {data_file_name(rank)}")
        if part.is_delta and part.reference is not None:
            references.add(part.reference)
        first = len(tensors)
        tensors.extend(part.tensors)
        items.append([{"t": "int", "v": rank}, _shift_ids(part.structure, first)])
        ranks.append({"rank": rank, "first_tensor": first, "tensors": len(part.tensors),
                      "file": data_file_name(rank), "metadata": part.metadata.get("user", {})})  # fmt: skip
    if len(references) > 1:  # every rank refers to the previous committed step: never reached unless corrupt
        raise RankFailedError(f"step {job.step}: the ranks' delta parts refer to different bases {references}")
    distributed = {"world_size": ctx.world_size, "session": ctx.session, "replicated": ctx.writers == (0,),
                   "ranks": ranks}  # fmt: skip
    return Manifest(step=job.step, created_unix=job.created_unix, library_version=__version__, tensors=tensors,
                    structure={"t": "dict", "items": items}, metadata={**job.metadata, DISTRIBUTED_KEY: distributed},
                    io_mode=storage.io_mode, reference=next(iter(references), None))  # fmt: skip


def _shift_ids(node: Any, offset: int) -> Any:
    if isinstance(node, dict):
        if node.get("t") == "tensor" and type(node.get("id")) is int:
            return {**node, "id": node["id"] + offset}
        return {k: _shift_ids(v, offset) for k, v in node.items()}
    if isinstance(node, list):
        return [_shift_ids(v, offset) for v in node]
    return node


def _wait_for_commit(root: Path, step: int, ctx: RankContext) -> Path:
    final = root / checkpoint_name(step)
    marker = abort_marker(root, step, ctx.session)
    # Twice rank 0's own limit: rank 0 may itself wait the full timeout for a slower rank and then
    # still commit; a follower that gave up earlier would report a failure for a committed step.
    deadline = time.monotonic() + 2 * ctx.commit_timeout_seconds
    pauses = _backoff(ctx)
    while True:
        committed = (final / MANIFEST_NAME).is_file()
        if committed:
            found = read_manifest(final).metadata.get(DISTRIBUTED_KEY)
            session = found.get("session") if isinstance(found, dict) else None
            if session != ctx.session:
                raise RankFailedError(f"{final}: committed by another job (session {session!r}); "
                                      "two jobs are saving into the same directory")  # fmt: skip
            # Rank 0 renames the directory and only then moves ``latest``: returning in between
            # would let this rank's next load("latest") read the previous step.
            if pointer_reaches(root, step):
                return final
        elif marker.exists():
            raise RankFailedError(f"step {step} not committed: {_reason(marker)}")
        if time.monotonic() > deadline:
            if committed:  # rank 0 died between its rename and its pointer update: the step is saved
                log.warning("asyncckpt: %s is committed but %s/latest still names an earlier step "
                            "(rank 0 stopped before updating it); load it by step", final, root)  # fmt: skip
                return final
            raise RankFailedError(
                f"step {step}: rank 0 (the committer) neither committed nor aborted it within "
                f"{2 * ctx.commit_timeout_seconds:g} s after rank {ctx.rank}'s part was durable; "
                "rank 0 is dead or hung. "
                f"The latest committed checkpoint in {root} is unchanged."
            )
        time.sleep(next(pauses))


def _sweep_aborted(root: Path, session: str) -> None:
    """Remove this job's temporaries of aborted steps that a late rank re-created (rank 0 only)."""
    suffix = f"-dist-{session}"
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            name = entry.name
            if name.startswith(".tmp-step-") and name.endswith(suffix):
                step_name = name[len(".tmp-") : -len(suffix)]
                if (root / f".abort-{step_name}-{session}").exists():
                    shutil.rmtree(entry.path, ignore_errors=True)


def remove_other_sessions(root: Path, session: str) -> list[Path]:
    """Remove temporaries and abort markers left by earlier incarnations of the job (rank 0, at start).

    Commit markers (``.committing-*``) are finished too, whatever host wrote them: rank 0 is the
    job's only committer and this incarnation has committed nothing yet, so any marker is a dead
    rank 0's, perhaps on another host, where the single-process cleanup leaves it alone.
    """
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(root):
            name = entry.name
            if is_commit_marker(name) and not entry.is_symlink():
                finish_interrupted_commit(root, name)
                removed.append(Path(entry.path))
                continue
            stale_tmp = name.startswith(".tmp-step-") and "-dist-" in name and not name.endswith(f"-dist-{session}")
            stale_abort = name.startswith(".abort-step-") and not name.endswith(f"-{session}")
            if stale_tmp:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
            elif stale_abort:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def rank_part(manifest: Manifest, rank: int, where: str) -> tuple[Manifest, Any, int]:
    """The sub-manifest of ``rank``'s tensors, its structure, and the id of its first tensor."""
    info = manifest.metadata.get(DISTRIBUTED_KEY)
    if not isinstance(info, dict) or not isinstance(info.get("ranks"), list):
        raise CheckpointError(f"{where}: not a distributed asyncckpt checkpoint (no {DISTRIBUTED_KEY!r} metadata)")
    if info.get("replicated") is True:
        rank = 0
    entries = {e["rank"]: e for e in info["ranks"] if isinstance(e, dict) and type(e.get("rank")) is int}
    if rank not in entries:
        raise CheckpointError(f"{where}: has no part for rank {rank} (saved by {info.get('world_size')} ranks: "
                              f"{sorted(k for k in entries if isinstance(k, int))})")  # fmt: skip
    entry = entries[rank]
    first, count = entry.get("first_tensor"), entry.get("tensors")
    if type(first) is not int or type(count) is not int or not 0 <= first <= first + count <= len(manifest.tensors):
        raise CheckpointError(f"{where}: corrupt distributed metadata for rank {rank}")
    items = manifest.structure.get("items") if isinstance(manifest.structure, dict) else None
    skeleton = next((pair[1] for pair in items or [] if isinstance(pair, list) and len(pair) == 2
                     and pair[0] == {"t": "int", "v": rank}), None)  # fmt: skip
    if skeleton is None:
        raise CheckpointError(f"{where}: structure has no entry for rank {rank}")
    return replace(manifest, tensors=manifest.tensors[first : first + count]), skeleton, first
