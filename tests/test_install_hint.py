"""The GPU install hint names the extra that matches torch's own CUDA build, and the extras pin what was run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from cli_env import REPO
from conftest import run_python

from asyncckpt._gpu.deps import extra_for_torch, mismatched_distributions
from asyncckpt._gpu.deps import gpu_extra_hint as hint_for
from asyncckpt.errors import gpu_extra_hint


@pytest.mark.parametrize(("cuda", "extra", "other"), [("13.0", "cu13", "cu12"), ("12.8", "cu12", "cu13")])
def test_the_hint_puts_the_matching_extra_first(cuda: str, extra: str, other: str) -> None:
    assert extra_for_torch(cuda) == extra
    first, second = hint_for(cuda).splitlines()
    assert first.startswith(f'pip install "asyncckpt[{extra}]"') and f"built for CUDA {cuda}" in first
    assert f'pip install "asyncckpt[{other}]"' in second and "follows torch's CUDA build" in second


@pytest.mark.parametrize("cuda", [None, "11.8"])
def test_without_a_matching_torch_it_says_to_install_one_first(cuda: str | None) -> None:
    text = hint_for(cuda or "")
    assert extra_for_torch(cuda or "") is None
    assert ("CPU-only build" in text) if cuda is None else ("built for CUDA 11.8" in text)
    assert 'pip install "asyncckpt[cu12]"' in text and 'pip install "asyncckpt[cu13]"' in text


def test_errors_use_this_torch() -> None:
    expected = extra_for_torch(torch.version.cuda)
    text = gpu_extra_hint()
    if expected is None:
        assert text.startswith("this torch")
    else:
        assert text.startswith(f'pip install "asyncckpt[{expected}]"')


def test_the_gpu_extras_pin_the_versions_that_ran_with_major_caps() -> None:
    text = Path(REPO, "pyproject.toml").read_text()
    for cuda in ("12", "13"):  # a TOML array of strings is JSON (tomllib needs Python 3.11; we support 3.10)
        line = re.search(rf"^cu{cuda} = (\[.*\])$", text, re.M)
        assert line is not None
        pins = {spec.split(">=")[0]: spec for spec in json.loads(line.group(1))}
        assert pins[f"nvidia-nvcomp-cu{cuda}"] == f"nvidia-nvcomp-cu{cuda}>=6.0,<7"  # the fast path needs nvCOMP 6
        assert pins[f"kvikio-cu{cuda}"] == f"kvikio-cu{cuda}>=26.10,<27"
        assert pins[f"cupy-cuda{cuda}x"] == f"cupy-cuda{cuda}x>=14.2,<15"
        assert all(",<" in spec for spec in pins.values()), pins


def test_gpu_packages_for_the_other_cuda_major_are_named() -> None:
    cu12_stack = ["cupy-cuda12x", "nvidia_nvcomp_cu12", "kvikio-cu12", "torch"]
    assert mismatched_distributions("13.0", cu12_stack) == ["cupy-cuda12x", "kvikio-cu12", "nvidia-nvcomp-cu12"]
    assert mismatched_distributions("12.8", cu12_stack) == []
    assert mismatched_distributions("13.0", ["cupy-cuda12x", "cupy-cuda13x"]) == []  # torch's own one is there
    assert mismatched_distributions(None, cu12_stack) == []  # a CPU torch: the CPU-only hint says what to do


def test_missing_gpu_packages_raise_the_hint_for_this_torch() -> None:
    # A real import failure in a child interpreter (the packages blocked as if not installed).
    code = (
        "import sys; sys.modules['nvidia.nvcomp'] = None\n"
        "from asyncckpt._gpu.deps import nvcomp\n"
        "try:\n    nvcomp()\nexcept ImportError as exc:\n    print(exc)\n"
    )
    out = run_python(code).stdout
    assert "needs the Python package 'nvidia.nvcomp'" in out and "matches torch's CUDA build" in out
    assert gpu_extra_hint() in out
