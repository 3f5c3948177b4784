"""``asyncckpt bench {stall,compression,cost} [ARGS...]``: run a benchmark from ``benchmarks/``.

The benchmarks live in the source checkout's ``benchmarks`` package, beside this package (they
are not part of the wheel: they pull in matplotlib and train models). This command finds them
there and hands them the remaining arguments, so ``asyncckpt bench stall --tiny`` is
``python -m benchmarks.stall_time --tiny``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

BENCHMARKS = {"stall": "stall_time", "compression": "compression", "cost": "cost_model"}


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "bench",
        help="measure checkpoint stall, compression or monthly cost on this machine (from a source checkout)",
        description="Run a benchmark: stall (asyncckpt vs torch.save vs DCP), compression (per tensor class), "
        "cost (GPU-hours and money per month). Arguments after the name go to the benchmark; "
        "add --help after the name for its options.",
    )
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    parser.set_defaults(func=run)


def _checkout_root(module: str) -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / f"{module}.py").is_file():
        raise CheckpointError(
            "the benchmarks are not installed with the package; run this from a source checkout of asyncckpt "
            "(git clone, then `pip install -e .` or `python -m asyncckpt bench ...` in its root)"
        )
    return root


def run(args: argparse.Namespace) -> int:
    """Run the benchmark in a child interpreter that finds the checkout's ``benchmarks`` package.

    A child, not an import: this process's ``sys.path`` stays what the installed package was given,
    and the benchmark's exit status, output and progress bar are its own.
    """
    module = BENCHMARKS[args.benchmark]
    root = _checkout_root(module)
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", f"benchmarks.{module}", *args.args]
    return subprocess.call(command, env={**os.environ, "PYTHONPATH": path})
