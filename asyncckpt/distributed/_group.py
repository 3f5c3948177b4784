"""Who this process is among the ranks, and the session token the ranks share.

Resolved once, on the main thread, when a :class:`~asyncckpt.distributed.DistributedCheckpointer`
is built; nothing here runs later or on another thread. Rank and world size come from an
initialised ``torch.distributed`` process group, else from explicit arguments, else from
torchrun's ``RANK``/``WORLD_SIZE``.

The session token names this incarnation of the job in every temporary file of a save, so a
restarted job never counts a dead incarnation's leftovers as its own ranks' parts. With a
process group it is drawn by rank 0 and broadcast **once, here, on the main thread** — the
only collective asyncckpt ever issues, and never from a background thread. Without one,
torchrun's ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT`` name the incarnation.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError

_SESSION = re.compile(r"[A-Za-z0-9]{1,64}")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    session: str


def resolve_rank_info(rank: int | None, world_size: int | None, session: str | None,
                      process_group: Any = None) -> RankInfo:  # fmt: skip
    """Rank, world size and session for this process. Main thread only (may broadcast once)."""
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if initialised:
        group_rank = dist.get_rank(process_group)
        group_size = dist.get_world_size(process_group)
        if (rank is not None and rank != group_rank) or (world_size is not None and world_size != group_size):
            raise CheckpointError(f"rank={rank}, world_size={world_size} disagree with the process group "
                                  f"(rank {group_rank} of {group_size}); leave them out")  # fmt: skip
        rank, world_size = group_rank, group_size
    else:
        rank = rank if rank is not None else _env_int("RANK", 0)
        world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", 1)
    if not 0 <= rank < world_size:
        raise CheckpointError(f"rank {rank} is not in [0, world_size={world_size})")
    if session is None:
        if initialised and world_size > 1:
            token = [uuid.uuid4().hex[:16] if rank == 0 else None]
            # The one collective: on the main thread, at construction, on every rank alike.
            dist.broadcast_object_list(token, src=dist.get_global_rank(process_group, 0) if process_group else 0,
                                       group=process_group)  # fmt: skip
            session = str(token[0])
        elif world_size == 1:
            session = uuid.uuid4().hex[:16]
        else:
            run_id = os.environ.get("TORCHELASTIC_RUN_ID")
            if not run_id:
                raise CheckpointError(
                    "cannot agree on a session with the other ranks: initialise torch.distributed first "
                    "(dist.init_process_group), run under torchrun, or pass session=<the same string on every rank>"
                )
            session = re.sub(r"[^A-Za-z0-9]", "", f"{run_id}r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if not _SESSION.fullmatch(session):
        raise CheckpointError(f"session must be 1-64 letters or digits, got {session!r}")
    return RankInfo(rank=rank, world_size=world_size, session=session)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise CheckpointError(f"environment variable {name}={raw!r} is not an integer") from None
