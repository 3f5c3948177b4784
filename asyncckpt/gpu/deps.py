"""Lazy access to the optional GPU packages (nvCOMP, KvikIO) and to CUDA itself.

Nothing here is imported at ``import asyncckpt`` time: a CPU-only machine, or one without
the GPU extra, imports the package fine and only fails when it asks for the GPU path, with a
:class:`~asyncckpt.errors.MissingDependencyError` that carries the ``pip install`` lines.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from ..errors import CheckpointError, MissingDependencyError, gpu_extra_hint

_modules: dict[str, ModuleType] = {}


def _load(module: str, what: str) -> Any:
    if module not in _modules:
        try:
            _modules[module] = importlib.import_module(module)
        except ImportError as exc:
            raise MissingDependencyError(
                f"{what} needs the Python package {module!r}, which is not importable here ({exc}).\n"
                f"Install the GPU extra for your CUDA driver:\n{gpu_extra_hint()}"
            ) from exc
    return _modules[module]


def nvcomp() -> Any:
    """The ``nvidia.nvcomp`` module (``nvidia-nvcomp-cu12``/``-cu13``)."""
    return _load("nvidia.nvcomp", "GPU compression (nvCOMP)")


def kvikio() -> Any:
    """The ``kvikio`` module (``kvikio-cu12``/``-cu13``), with ``kvikio.defaults`` loaded."""
    module = _load("kvikio", "GPU file I/O (KvikIO)")
    _load("kvikio.defaults", "GPU file I/O (KvikIO)")  # a submodule `import kvikio` does not load
    return module


def cupy() -> Any:
    """The ``cupy`` module (``cupy-cuda12x``/``-cuda13x``): compiles the few kernels torch lacks."""
    return _load("cupy", "GPU checksums and chunk packing (CuPy)")


def require_cuda(what: str) -> torch.device:
    """The current CUDA device; raises CheckpointError naming ``what`` when CUDA is absent."""
    if not torch.cuda.is_available():
        raise CheckpointError(
            f"{what} needs a CUDA GPU, and torch sees none here (torch {torch.__version__}). On a GPU machine, "
            f"install the GPU extra:\n{gpu_extra_hint()}"
        )
    return torch.device("cuda", torch.cuda.current_device())


def gpu_path_available() -> bool:
    """True when CUDA, nvCOMP and KvikIO are all usable (the GPU path can run)."""
    if not torch.cuda.is_available():
        return False
    try:
        nvcomp()
        kvikio()
        cupy()
    except MissingDependencyError:
        return False
    return True
