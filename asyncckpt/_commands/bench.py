"""``asyncckpt bench {stall,compression,cost} [ARGS...]``: run a benchmark of a source checkout.

The benchmarks are not part of the wheel (they pull in matplotlib and train models): they live
in a source checkout of asyncckpt, ``benchmarks/`` and ``docs/tools/cost_model.py``. This
command works only where this package *is* that checkout (``pip install -e .``, or
``python -m asyncckpt`` in its root); an installed wheel says so and runs nothing. It hands the
remaining arguments to the benchmark, so ``asyncckpt bench stall --tiny`` is
``python -m benchmarks.stall_time --tiny`` in the checkout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

BENCHMARKS = {"stall": "benchmarks/stall_time.py", "compression": "benchmarks/compression.py",
              "cost": "docs/tools/cost_model.py"}  # fmt: skip


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure checkpoint stall, compression or monthly cost on this machine (needs a source checkout)",
        description="Run a benchmark of the source checkout this package was installed from (pip install -e): "
        "stall (asyncckpt vs torch.save vs DCP), compression (per tensor class), cost (GPU-hours and money per "
        "month). Arguments after the name go to the benchmark; add --help after the name for its options.",
    )
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    parser.set_defaults(func=run)


def _checkout_root(script: str) -> Path:
    """The source checkout this package runs from; an error that says so where it is an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    # pyproject.toml beside the package: a site-packages folder that happens to hold a "benchmarks" is no checkout.
    if not (root / "pyproject.toml").is_file() or not (root / script).is_file():
        raise CheckpointError(
            f"asyncckpt bench runs the benchmarks of a source checkout, and this asyncckpt ({root / 'asyncckpt'}) "
            f"is not in one that has {script} (a wheel does not ship them). Clone the repository, then run "
            "`pip install -e .` and `asyncckpt bench ...`, or `python -m asyncckpt bench ...` in its root"
        )
    return root


def run(args: argparse.Namespace) -> int:
    """Run the benchmark in a child interpreter, with the checkout first on its ``PYTHONPATH``.

    A child, not an import: this process's ``sys.path`` stays what the installed package was given,
    and the benchmark's exit status, output and progress bar are its own.
    """
    script = BENCHMARKS[args.benchmark]
    root = _checkout_root(script)
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    if script.startswith("benchmarks/"):
        command = [sys.executable, "-m", script.removesuffix(".py").replace("/", "."), *args.args]
    else:
        command = [sys.executable, str(root / script), *args.args]
    return subprocess.call(command, env={**os.environ, "PYTHONPATH": path})
