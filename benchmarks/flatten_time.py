"""How long ``flatten()`` holds the training thread, for two asyncckpt trees side by side in one run.

The state is a model's and an AdamW optimizer's state dicts (``--layers`` linear layers, two
tensors each, and per parameter a dict of ``step``/``exp_avg``/``exp_avg_sq``), so the walk
meets what ``save()`` meets: a few hundred tensors in dicts, and param_groups lists of ints.
Each tree runs in its own subprocess (``PYTHONPATH`` picks the tree), the rounds alternate
between the trees so that drift in the machine hits both, and the report gives the median of
each round's best time per tree and the ratio of the second tree to the first::

    python3 benchmarks/flatten_time.py /path/to/old/tree /path/to/new/tree

Three timings: ``flatten`` alone (the training thread's share in ``save()``), ``flatten``
followed by reading ``.skeleton`` and ``.keys`` (the whole walk, wherever it runs), and ``full``:
``flatten`` of the same state with a ``torch.dtype`` beside it, which takes the full walk.
``--tiny`` is the smoke-test size. Runs on the calling thread, CPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_WORKER = """
import json, sys, time
import torch
from asyncckpt._tree import flatten

layers, repeats = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(2, 16)).sum().backward()
optimizer.step()
state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 100, "epoch": 1.5}

def best(fn):
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)

def whole():
    flat = flatten(state)
    flat.skeleton, flat.keys

# A torch.dtype is outside the fast path: this state takes the full walk.
unusual = {**state, "dtype": torch.bfloat16}
best(whole)  # warm up
print(json.dumps({"flatten": best(lambda: flatten(state)), "whole": best(whole), "full": best(lambda: flatten(unusual)),
                  "tensors": len(flatten(state).leaf_tensors), "module": __import__("asyncckpt").__file__}))
"""


def _run(tree: str, layers: int, repeats: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    # Run from the tree itself: ``-c`` puts the working directory ahead of PYTHONPATH.
    out = subprocess.run([sys.executable, "-c", _WORKER, str(layers), str(repeats)], env=env, cwd=tree, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    result: dict[str, float] = json.loads(out)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs=2, help="two directories that each hold an asyncckpt package (first: baseline)")
    p.add_argument("--layers", type=int, default=100, help="linear layers (4 tensors of state each, with AdamW)")
    p.add_argument("--rounds", type=int, default=7, help="subprocesses per tree, alternating")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per subprocess (its best counts)")
    p.add_argument("--tiny", action="store_true", help="a small state and two short rounds (smoke test)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.rounds, args.repeats = 4, 2, 3
    runs: list[list[dict[str, float]]] = [[], []]
    for _ in range(args.rounds):
        for tree, results in zip(args.trees, runs, strict=True):
            results.append(_run(tree, args.layers, args.repeats))
    report = {"tensors": runs[0][0]["tensors"], "modules": [r[0]["module"] for r in runs]}
    for measure in ("flatten", "whole", "full"):
        medians = [statistics.median(r[measure] for r in results) for results in runs]
        report[measure] = {"baseline_us": medians[0] * 1e6, "new_us": medians[1] * 1e6,
                           "ratio_new_over_baseline": medians[1] / medians[0]}  # fmt: skip
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
