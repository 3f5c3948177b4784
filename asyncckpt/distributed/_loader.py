"""Load one rank's part of a distributed checkpoint (or all parts, for inspection).

Runs on the calling thread; reads only the data file(s) of the rank asked for, verifying every
blob's checksum as :func:`asyncckpt.load` does. ``asyncckpt.load`` itself also works on a
distributed checkpoint and returns ``{rank: state}`` for all ranks (handy to consolidate).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from .._loader import MapLocation, load_tensors, naming_fallback
from .._manifest import read_manifest
from .._resolve import resolve_for_reading
from .._tree import unflatten
from ..errors import CorruptCheckpointError
from ..observer import notify_load_finished
from ._protocol import rank_part


def load_rank(directory_or_checkpoint: str | os.PathLike[str], rank: int | None = None, step: int | str = "latest",
              map_location: MapLocation = None) -> Any:  # fmt: skip
    """Return ``rank``'s state from a distributed checkpoint (default: this process's rank).

    For a checkpoint saved with ``replicated=True`` every rank gets rank 0's state.

    Raises:
        CheckpointError: not a distributed checkpoint, or it has no part for ``rank``.
        CorruptCheckpointError: as :func:`asyncckpt.load`.
    """
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    began = time.perf_counter()
    resolved = resolve_for_reading(directory_or_checkpoint, step)  # as load(): no silent fallback, no symlinks
    path = resolved.path
    with naming_fallback(resolved):
        manifest = read_manifest(path)
        part, skeleton, first = rank_part(manifest, rank, str(path))
        tensors = load_tensors(path, part, map_location)

        def tensor_at(index: int) -> torch.Tensor:
            if not first <= index < first + len(tensors):
                raise CorruptCheckpointError(
                    f"{path}: rank {rank}'s structure refers to tensor {index}, outside its part"
                )
            return tensors[index - first]

        state = unflatten(skeleton, tensor_at, f"{path} (rank {rank})")
    notify_load_finished(time.perf_counter() - began)  # the asyncckpt_load_seconds metric, as for load()
    return state
