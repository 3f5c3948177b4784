"""Lazy access to the optional GPU packages (nvCOMP, KvikIO) and to CUDA itself.

Nothing here is imported at ``import asyncckpt`` time: a CPU-only machine, or one without
the GPU extra, imports the package fine and only fails when it asks for the GPU path, with a
:class:`~asyncckpt.errors.MissingDependencyError` that carries the ``pip install`` lines.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch

from .._install_hint import EXTRAS, extra_for_torch, gpu_extra_hint
from ..errors import CheckpointError, MissingDependencyError

_modules: dict[str, ModuleType] = {}

_GPU_DISTRIBUTIONS = {
    major: (f"cupy-cuda{major}x", f"nvidia-nvcomp-cu{major}", f"kvikio-cu{major}") for major in EXTRAS
}
"""The distributions each extra installs that are built for one CUDA major."""


def mismatched_distributions(torch_cuda: str | None, installed: Iterable[str]) -> list[str]:
    """GPU packages in ``installed`` (distribution names) built for another CUDA major than torch's,
    where the one for torch's major is absent (so the import would load the wrong one).

    pip installs ``asyncckpt[cu12]`` beside a torch built for CUDA 13 without a word, and the
    result loads two CUDA runtimes into one process; this names what to replace.
    """
    extra_major = next((m for m, e in EXTRAS.items() if e == extra_for_torch(torch_cuda)), None)
    if extra_major is None:
        return []
    names = {name.lower().replace("_", "-") for name in installed}
    wrong = []
    for role, wanted in enumerate(_GPU_DISTRIBUTIONS[extra_major]):
        if wanted not in names:
            wrong += [ds[role] for m, ds in _GPU_DISTRIBUTIONS.items() if m != extra_major and ds[role] in names]
    return sorted(wrong)


def _check_cuda_match() -> None:
    """Raise MissingDependencyError when the installed GPU packages were built for another CUDA than torch."""
    names = [d.metadata["Name"] or "" for d in importlib.metadata.distributions()]
    wrong = mismatched_distributions(torch.version.cuda, names)
    if wrong:
        raise MissingDependencyError(
            f"{', '.join(wrong)} are built for another CUDA major than this torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}): pip uninstall -y {' '.join(wrong)}, then:\n{gpu_extra_hint()}"
        )


def _load(module: str, what: str) -> Any:
    if module not in _modules:
        if not _modules:  # the first GPU package this process asks for: check the set once
            _check_cuda_match()
        try:
            _modules[module] = importlib.import_module(module)
        except ImportError as exc:
            raise MissingDependencyError(
                f"{what} needs the Python package {module!r}, which is not importable here ({exc}).\n"
                f"Install the GPU extra that matches torch's CUDA build:\n{gpu_extra_hint()}"
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


def gpu_path_installed() -> bool:
    """True when CUDA is visible and nvCOMP, KvikIO and CuPy are installed (found, not imported: cheap)."""
    if not torch.cuda.is_available():
        return False
    try:
        return all(importlib.util.find_spec(name) is not None for name in ("nvidia.nvcomp", "kvikio", "cupy"))
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


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
