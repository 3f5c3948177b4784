"""Checkpoints of jobs with several ranks (torchrun).

:class:`DistributedCheckpointer` writes one data file per rank and commits a step only when
every rank's part is durable, coordinating through the shared checkpoint directory (never a
collective from a background thread); :func:`load_rank` gives each rank its own part. For
``torch.distributed.checkpoint`` (DCP, FSDP2, torchtitan) see :mod:`asyncckpt.integrations.dcp`.
"""

from ._checkpointer import DistributedCheckpointer
from ._loader import load_rank
from ._protocol import RankFailedError

__all__ = ["DistributedCheckpointer", "RankFailedError", "load_rank"]
