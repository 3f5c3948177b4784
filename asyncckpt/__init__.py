"""asyncckpt: asynchronous, compressed checkpoints for PyTorch training.

``save()`` snapshots the state and returns at once; a worker thread compresses (zstd on CPU,
nvCOMP on GPU), writes (POSIX, or KvikIO/GPUDirect Storage), fsyncs and commits atomically.
"""

from ._checkpointer import AsyncCheckpointer
from ._handle import SaveHandle
from ._layout import CheckpointInfo, latest_step, list_checkpoints
from ._loader import VerifyReport, load, verify
from ._version import __version__
from .errors import CheckpointError, CorruptCheckpointError, MissingDependencyError, SaveFailedError
from .options import CheckpointOptions
from .result import SaveResult

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointOptions",
    "CorruptCheckpointError",
    "MissingDependencyError",
    "SaveFailedError",
    "SaveHandle",
    "SaveResult",
    "VerifyReport",
    "__version__",
    "latest_step",
    "list_checkpoints",
    "load",
    "verify",
]
