"""Exceptions raised by asyncckpt.

Every error the library raises on purpose derives from :class:`CheckpointError`, so a
training loop can catch one type. The one exception is unsupported state passed to
``save()``, which raises the built-in :class:`TypeError` (it is a programming error in
the caller, found before anything is written).
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every asyncckpt error."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint on disk failed verification: checksum, sizes, or a malformed manifest."""


class SaveFailedError(CheckpointError):
    """A background save failed; ``__cause__`` holds the worker's original exception."""


class MissingDependencyError(CheckpointError, ImportError):
    """An optional package (nvCOMP, KvikIO, CuPy, ...) is needed but not installed."""


def gpu_extra_hint() -> str:
    """The pip lines that install the GPU extras, for error messages: the one matching torch's CUDA build first."""
    from ._install_hint import gpu_extra_hint as hint  # lazily: it imports torch

    return hint()
