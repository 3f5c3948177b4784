"""Which GPU extra to install: the one matching torch's CUDA build, and the lines that say so.

Imports only torch (nothing else of asyncckpt), so error messages anywhere can name the extra
without importing the GPU package. Any thread.
"""

from __future__ import annotations

import torch

__all__ = ["EXTRAS", "extra_for_torch", "gpu_extra_hint"]

EXTRAS = {12: "cu12", 13: "cu13"}
"""The GPU extra for each CUDA major torch can be built for (``pyproject.toml``'s optional dependencies)."""


def extra_for_torch(cuda_version: str | None = None) -> str | None:
    """The extra matching torch's CUDA build (``torch.version.cuda``, e.g. "13.0" -> "cu13"); None if none does.

    The extra follows the CUDA that torch was built for, not the driver: a driver runs every older
    CUDA, and cupy/nvCOMP/KvikIO built for another CUDA major than torch's would load a second
    CUDA runtime beside torch's.
    """
    version = torch.version.cuda if cuda_version is None else cuda_version
    if not version:
        return None
    major = version.split(".")[0]
    return EXTRAS.get(int(major)) if major.isdigit() else None


def gpu_extra_hint(cuda_version: str | None = None) -> str:
    """The ``pip install`` lines for the GPU extra, naming the one that matches torch's CUDA build first."""
    version = torch.version.cuda if cuda_version is None else cuda_version
    extra = extra_for_torch(version)
    if extra is not None:
        other = next(f"CUDA {m}" for m, e in EXTRAS.items() if e != extra)
        other_line = next(f'pip install "asyncckpt[{e}]"' for e in EXTRAS.values() if e != extra)
        matches = f"matches this torch {torch.__version__} (built for CUDA {version})"
        return (f'pip install "asyncckpt[{extra}]"   # {matches}\n'
                f"(the extra follows torch's CUDA build: with a torch built for {other}, {other_line})")  # fmt: skip
    if version:
        why = (
            f"this torch {torch.__version__} is built for CUDA {version}, and asyncckpt's GPU path needs CUDA 12 "
            "or 13; install a torch built for one of them first"
        )
    else:
        why = f"this torch {torch.__version__} is a CPU-only build; install a CUDA build of torch first"
    return (f"{why}, then the extra for its CUDA major (python -c 'import torch; print(torch.version.cuda)'):\n"
            'pip install "asyncckpt[cu12]"   # torch built for CUDA 12.x\n'
            'pip install "asyncckpt[cu13]"   # torch built for CUDA 13.x')  # fmt: skip
