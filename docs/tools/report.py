"""Keep ``benchmarks/results/`` and ``docs/benchmarks.md`` in step with the measurements.

    python docs/tools/report.py --import DIR    # copy a run_h200.sh $OUT into benchmarks/results/ (dated names)
    python docs/tools/report.py                 # rewrite the generated blocks of docs/benchmarks.md
    python docs/tools/report.py --readme        # print the headline table and chart for the README

The document's prose is written by hand; only the blocks between ``<!-- BEGIN name -->`` and
``<!-- END name -->`` are generated, from the newest committed results: the headline table for
the README, the stall-time tables and charts (GPU and CPU), the compression tables, and the cost
model (run now on the newest results, GPU ones preferred). Like ``cost_model.py`` beside it, a
script of the source checkout that puts the checkout's root first on ``sys.path``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import cost_model  # noqa: E402 - the script beside this one (its folder is on sys.path)
from cost_model import RESULTS_DIR, latest_result  # noqa: E402

from benchmarks.common import fmt_bytes, fmt_seconds, machine_label, write_atomically  # noqa: E402

DOC = REPO_ROOT / "docs" / "benchmarks.md"
RUN_FILES = ("stall_time.json", "stall_time.md", "stall_time.png", "compression.json", "compression.md")


def import_run(directory: Path, results: Path = RESULTS_DIR) -> list[Path]:
    """Copy the files of one run_h200.sh output into ``results`` under dated, GPU-named stems."""
    copied = []
    stall = json.loads((directory / "stall_time.json").read_text())
    stem = _stem(stall)
    for name in RUN_FILES:
        source = directory / name
        if source.is_file():
            kind, _, ext = name.partition(".")
            target = results / f"{kind}-{stem}.{ext}"
            shutil.copyfile(source, target)
            copied.append(target)
    logs = [directory / n for n in ("run.log", "gpu-tests.log") if (directory / n).is_file()]
    if logs:
        target = results / f"run_h200-{stem}.log"
        target.write_text("".join(f"==> {log.name} <==\n{log.read_text(errors='replace')}\n" for log in logs))
        copied.append(target)
    return copied


def _stem(report: dict[str, Any]) -> str:
    stamp = report["created_utc"].replace("-", "").replace(":", "").replace("T", "-").rstrip("Z")
    gpu = (report["machine"].get("gpu") or "cpu").lower().replace("nvidia", "")
    return f"{stamp}-{''.join(c for c in gpu if c.isalnum()) or 'gpu'}"


# ------------------------------------------------------------------------------------------------ blocks
def _relative(path: Path) -> str:
    return "../" + str(path.relative_to(REPO_ROOT))


def headline(path: Path) -> str:
    """The README's table: per method, training blocked per save, durable after, bytes stored."""
    report = json.loads(path.read_text())
    model = report["model"]
    lines = [
        f"Measured on {machine_label(report['machine'])}, {report['created_utc'][:10]}: a "
        f"{_params(model['parameters'])}-parameter transformer, {fmt_bytes(model['state_bytes'])} of state "
        f"(FP32 weights, AdamW moments, gradients), trained on real text; local disk "
        f"{(report['limits'].get('storage') or {}).get('write_bytes_per_second', 0) / 1e9:.2g} GB/s.",
        "",
        "| way to save | training blocked per save | durable after | bytes stored |",
        "|---|---|---|---|",
    ]
    for entry in report["methods"]:
        if entry["kind"] == "baseline" or not entry["available"] or not entry["samples"]:
            continue
        s = entry["summary"]
        lines.append(
            f"| {entry['label']} | {fmt_seconds(s['blocked_seconds_median'])} "
            f"| {fmt_seconds(s['durable_seconds_median'])} | {fmt_bytes(s['stored_bytes'])} "
            f"({s['ratio']:.3f}x) |"
        )
    if not report["machine"].get("gpu"):
        lines += ["", "_CPU figures from a shared two-core machine, noisy in absolute terms: compare the methods with "
                  "each other. GPU figures replace them once a GPU run is committed._"]  # fmt: skip
    chart = path.with_suffix(".png")
    if chart.is_file():
        lines += ["", f"![stall per method]({_relative(chart)})"]
    return "\n".join(lines)


def _params(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.3g}M"


def result_block(path: Path | None, what: str) -> str:
    if path is None:
        return f"_No {what} results committed yet._"
    report = json.loads(path.read_text())
    text = path.with_suffix(".md").read_text().strip() if path.with_suffix(".md").is_file() else ""
    chart = path.with_suffix(".png")
    parts = [text]
    if chart.is_file():
        parts.append(f"![{what}]({_relative(chart)})")
    parts.append(f"Files: `{path.relative_to(REPO_ROOT)}` (and `.md`{', `.png`' if chart.is_file() else ''}). "
                 f"Command: `{report.get('command', '?')}`.")  # fmt: skip
    return "\n\n".join(parts)


def cost_block() -> str:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            cost_model.main([])
    except SystemExit as exc:
        return f"_Not computed: {exc}_"
    return out.getvalue().strip() + f"\n\nCommand: `{cost_model.PROG}` (every input is a flag: `--help`)."


def blocks() -> dict[str, str]:
    stall_gpu, stall_cpu = latest_result("stall_time", gpu=True), latest_result("stall_time", gpu=False)
    best = stall_gpu or stall_cpu
    return {
        "headline": headline(best) if best else "_No results committed yet._",
        "stall-gpu": result_block(stall_gpu, "GPU stall-time"),
        "stall-cpu": result_block(stall_cpu, "CPU stall-time"),
        "compression-gpu": result_block(latest_result("compression", gpu=True), "GPU compression"),
        "compression-cpu": result_block(latest_result("compression", gpu=False), "CPU compression"),
        "cost": cost_block(),
    }


def _fill(body: str, match: re.Match[str]) -> str:
    return match.group(1) + body.rstrip("\n") + "\n" + match.group(2)


def refresh(doc: Path = DOC) -> list[str]:
    """Rewrite every generated block of ``doc``; returns the names of the blocks it found."""
    text = doc.read_text()
    found = []
    for name, body in blocks().items():
        pattern = re.compile(rf"(<!-- BEGIN {re.escape(name)} -->\n)(?:.*?\n)?(<!-- END {re.escape(name)} -->)", re.S)
        if pattern.search(text):
            text = pattern.sub(partial(_fill, body), text)
            found.append(name)
    write_atomically(doc, text)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python docs/tools/report.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--import", dest="import_dir", type=Path, default=None,
                        help="a run_h200.sh output directory to copy into benchmarks/results/ first")  # fmt: skip
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--readme", action="store_true",
                        help="only print the headline block, paths relative to the repository root")  # fmt: skip
    args = parser.parse_args(argv)
    if args.readme:
        best = latest_result("stall_time")
        print(headline(best).replace("](../", "](") if best else "No results committed yet.")
        return 0
    if args.import_dir is not None:
        for path in import_run(args.import_dir):
            print(f"imported {path.relative_to(REPO_ROOT)}")
    print(f"refreshed {args.doc}: {', '.join(refresh(args.doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
