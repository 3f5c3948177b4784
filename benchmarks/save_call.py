"""How long ``AsyncCheckpointer.save()`` holds the training thread, per optimizer and snapshot mode.

The pipeline benchmark (:mod:`benchmarks.gpu_pipeline`) uses fused AdamW, whose ``step`` counters
live on the GPU. PyTorch's default AdamW (``foreach``) keeps one 0-dim CPU ``step`` tensor per
parameter, so a state on CUDA is mixed and ``save()`` also stages those CPU tensors. This
measures the call itself for both optimizers: host time from the call to its return, the
training stream synchronised before (median, p90 and min over ``--saves`` saves, each followed
by a training step, as in training, and waited for before the next).

It imports asyncckpt from wherever Python finds it, so two trees can be compared side by side
in one session (``--label`` names the tree in the report)::

    python3 benchmarks/save_call.py --out OUT --label new
    PYTHONPATH=/path/to/old/tree python3 benchmarks/save_call.py --out OUT --label old

Run as a script (not ``-m``) for that, so the current directory's asyncckpt is not found first.
``--tiny`` is the smoke-test size (CI, CPU). Progress goes to stderr; the report to OUT as
``save_call-<label>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import asyncckpt
from asyncckpt._tree import flatten
from asyncckpt.testing.demo_model import TextBatches, TinyGPT, stdlib_text, train_step


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for the JSON/Markdown report and scratch")
    p.add_argument("--label", default="asyncckpt", help="names the asyncckpt tree in the report's file names")
    p.add_argument("--saves", type=int, default=12, help="saves per optimizer and mode (the first is dropped)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--only", action="append", default=[], metavar="OPTIMIZER:MODE",
                   help="measure only these rows, e.g. adamw-fused:device (repeatable)")  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="a small model and 4 saves (smoke test)")
    args = p.parse_args(argv)
    if args.tiny:
        args.width, args.layers, args.saves = 64, 2, 4
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(optimizer_kind: str, mode: str, device: torch.device, args: argparse.Namespace,
             scratch: Path) -> dict[str, Any]:  # fmt: skip
    torch.manual_seed(0)
    model = TinyGPT(width=args.width, layers=args.layers, heads=4, context=64).to(device)
    fused = optimizer_kind == "adamw-fused"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    batches = TextBatches(stdlib_text(1 << 20), model.context, batch=4, device=device)
    for _ in range(2):
        train_step(model, optimizer, batches)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 0}
    leaves = flatten(state).leaf_tensors  # distinct tensors: a tied weight counts once
    samples = []
    with (
        tempfile.TemporaryDirectory(dir=scratch) as where,
        asyncckpt.AsyncCheckpointer(where, snapshot=mode, keep_last=1) as ckpt,
    ):
        for i in range(args.saves):
            _sync(device)
            began = time.perf_counter()
            handle = ckpt.save(i + 1, state)
            samples.append(time.perf_counter() - began)
            train_step(model, optimizer, batches)  # fence: this step waits on the GPU, not the host
            handle.result(300)
    kept = sorted(samples[1:])  # the first save allocates staging and compiles kernels
    return {
        "optimizer": optimizer_kind, "mode": mode, "tensors": len(leaves),
        "cpu_tensors": sum(1 for t in leaves if t.device.type == "cpu"),
        "state_bytes": sum(t.nbytes for t in leaves),
        "median_seconds": statistics.median(kept), "p90_seconds": kept[min(len(kept) - 1, int(0.9 * len(kept)))],
        "min_seconds": kept[0], "samples_seconds": samples,
    }  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# save() call time — {report['label']}, {report['date']}",
        "",
        f"{report['device']}; torch {report['torch']}, asyncckpt from `{report['asyncckpt_path']}`. "
        f"Model: TinyGPT width {report['width']}, {report['layers']} layers; {report['saves']} saves per row, "
        "the first dropped.",
        "",
        "| optimizer | mode | distinct tensors (CPU) | state | save() median | p90 | min |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['optimizer']} | {row['mode']} | {row['tensors']} ({row['cpu_tensors']}) | "
            f"{row['state_bytes'] / 1e6:.0f} MB | {row['median_seconds'] * 1e3:.3f} ms | "
            f"{row['p90_seconds'] * 1e3:.3f} ms | {row['min_seconds'] * 1e3:.3f} ms |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.out / f"scratch-{args.label}"
    scratch.mkdir(exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    plan = [("adamw-foreach", m) for m in (("fence", "device") if cuda else ("host",))]
    if cuda:
        plan += [("adamw-fused", m) for m in ("fence", "device")]
    if args.only:
        plan = [(o, m) for o, m in plan if f"{o}:{m}" in args.only]
    rows = []
    for optimizer_kind, mode in plan:
        row = _measure(optimizer_kind, mode, device, args, scratch)
        print(f"[{args.label}] {optimizer_kind} {mode}: save() median {row['median_seconds'] * 1e3:.3f} ms "
              f"({row['tensors']} tensors, {row['cpu_tensors']} on the CPU)", file=sys.stderr)  # fmt: skip
        rows.append(row)
    scratch.rmdir()
    report = {
        "benchmark": "save_call", "label": args.label, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(device) if cuda else "CPU", "torch": torch.__version__,
        "asyncckpt_path": str(Path(asyncckpt.__file__).parent), "width": args.width, "layers": args.layers,
        "saves": args.saves, "rows": rows,
    }  # fmt: skip
    (args.out / f"save_call-{args.label}.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (args.out / f"save_call-{args.label}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
