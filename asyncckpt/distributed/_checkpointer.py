"""The checkpointer for jobs with several ranks (torchrun): one data file per rank, one commit.

Threads, per rank: the training thread stages its own state in ``save()`` exactly as the
single-process :class:`~asyncckpt.AsyncCheckpointer` does (no communication at all); the
worker thread writes ``data-r{rank}.bin`` and then takes part in the file-system commit of
:mod:`asyncckpt.distributed._protocol`. No collective is ever issued after construction, so a
save can never deadlock or corrupt the training process group.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from .._checkpointer import AsyncCheckpointer
from .._handle import SaveHandle
from ..errors import CheckpointError
from ..observer import SaveObserver
from ._group import resolve_rank_info
from ._loader import load_rank
from ._protocol import RankCommitter, RankContext, remove_other_sessions

log = logging.getLogger("asyncckpt")

DEFAULT_COMMIT_TIMEOUT_SECONDS = 600.0


class DistributedCheckpointer(AsyncCheckpointer):
    """Asynchronous checkpoints of a job with several ranks, committed only when every rank's part is durable.

    Every rank builds one (all with the same ``directory``, which all ranks must share, e.g. a
    parallel or network file system) and calls ``save(step, state)`` with the same steps. Each
    rank stores its own ``state`` (its shards); :meth:`load` gives each rank back its own part.

    Args:
        directory: the run directory, shared by all ranks.
        replicated: the state is the same on every rank (DDP): only rank 0 writes it, every rank
            still calls ``save()`` (cheaply) and learns whether it committed, and every rank loads
            rank 0's copy.
        commit_timeout_seconds: how long rank 0 waits for the other ranks' parts, after its own is
            durable, before it aborts the save (a dead or hung rank); other ranks wait twice as
            long for rank 0. Argument > ``ASYNCCKPT_COMMIT_TIMEOUT_SECONDS`` > 600.
        rank, world_size: only when ``torch.distributed`` is not initialised (else taken from it).
        session: a token naming this incarnation of the job, the same on every rank; by default
            broadcast once from rank 0 here, on the main thread (see :mod:`._group`).
        process_group: the group whose ranks take part (default: the whole job).
        observer, registry, **options: as for :class:`~asyncckpt.AsyncCheckpointer`; metrics are
            per rank (the exporter listens on ``metrics_port`` + local rank). ``delta_reference`` is
            ``"previous"`` here, and ``"full"`` with ``delta`` on is refused (:func:`_delta_reference` says why).
    """

    def __init__(self, directory: str | os.PathLike[str], *, replicated: bool = False,
                 commit_timeout_seconds: float | None = None, rank: int | None = None,
                 world_size: int | None = None, session: str | None = None, process_group: Any = None,
                 observer: SaveObserver | None = None, registry: Any = None, **options: Any) -> None:  # fmt: skip
        options["delta_reference"] = _delta_reference(options)
        info = resolve_rank_info(rank, world_size, session, process_group)
        timeout = commit_timeout_seconds
        if timeout is None:
            raw = os.environ.get("ASYNCCKPT_COMMIT_TIMEOUT_SECONDS")
            try:
                timeout = float(raw) if raw else DEFAULT_COMMIT_TIMEOUT_SECONDS
            except ValueError:
                raise ValueError(f"ASYNCCKPT_COMMIT_TIMEOUT_SECONDS={raw!r} is not a number of seconds") from None
        if not timeout > 0:
            raise ValueError(f"commit_timeout_seconds must be > 0, got {timeout}")
        writers = (0,) if replicated else tuple(range(info.world_size))
        self.context = RankContext(rank=info.rank, world_size=info.world_size, session=info.session,
                                   writers=writers, commit_timeout_seconds=timeout)  # fmt: skip
        super().__init__(directory, observer=observer, registry=registry,
                         _committer=RankCommitter(Path(directory), self.context), **options)  # fmt: skip
        if info.rank == 0:
            for stale in remove_other_sessions(self.directory, info.session):
                log.info("asyncckpt: removed %s, left by an earlier run of this job", stale)

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    def save(self, step: int, state: object, *, metadata: dict[str, Any] | None = None,
             full: bool = False) -> SaveHandle:  # fmt: skip
        """Stage this rank's ``state`` and return; the commit waits for every rank. Training thread.

        Every rank must call it with the same ``step`` (and the same ``full``: with the ``delta``
        option, each rank's data refers to its own data in the previous committed step). The
        handle's ``result()`` raises :class:`~asyncckpt.SaveFailedError` on every rank if any rank failed.
        """
        if self.context.rank not in self.context.writers:
            state = {}  # a replica: rank 0 stores the state; this rank only follows the commit
        return super().save(step, state, metadata=metadata, full=full)

    def preallocate(self, state: object) -> threading.Thread:
        """As :meth:`AsyncCheckpointer.preallocate`; a replica (which stores nothing) allocates nothing."""
        return super().preallocate(state if self.context.rank in self.context.writers else {})

    def load(self, step: int | str = "latest", map_location: Any = None) -> Any:
        """This rank's part of checkpoint ``step`` (rank 0's for a replicated save). Calling thread."""
        return load_rank(self.directory, self.context.rank, step=step, map_location=map_location)


def _delta_reference(options: dict[str, Any]) -> str:
    """``previous`` unless given; ``full`` with ``delta`` on is refused.

    Against the chain's full save, each rank would decide for itself when a chain starts (the GPU
    path starts one when the memory for its references has arrived, which differs between ranks),
    so the ranks' parts of one step could refer to different steps, and every such save would fail
    at the commit. Against the save before, every rank refers to the last committed step.
    """
    given = options.get("delta_reference") or os.environ.get("ASYNCCKPT_DELTA_REFERENCE") or "previous"
    delta = options.get("delta") or os.environ.get("ASYNCCKPT_DELTA") or "off"
    if given == "full" and delta != "off":
        raise CheckpointError(
            "DistributedCheckpointer takes deltas against the save before only: with delta_reference='full' "
            "each rank would choose its own full save, and a step whose ranks refer to different ones cannot "
            "commit. Use delta_reference='previous' (the default here)"
        )
    return str(given)
