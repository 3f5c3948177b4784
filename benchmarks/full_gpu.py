"""Checkpointing a nearly full GPU: training time lost, durable time and peak extra memory per method.

The regime large-model users live in: tens of GB of optimizer state on a GPU that training has
nearly filled. For each model size (``--sizes``, TinyGPT width x layers, fused AdamW, BF16
autocast, trained on real text), the GPU is filled with a placeholder allocation until
``--gpu-free-gb`` remain, then each method (``--methods``, names as in :mod:`benchmarks.methods`)
saves the state (weights + optimizer, no gradients) ``--saves`` times while training goes on.
Per save it reports:

* the ``save()`` call (host seconds on the training thread);
* **training time lost**: the call plus, for every step that ran until the checkpoint was
  durable, its time minus the baseline step time (median of steps with no save in flight);
* durable seconds, stored bytes, and the disk's own write bandwidth measured in the same run;
* peak extra GPU memory (driver-reported, sampled every 20 ms: nvCOMP's allocations count), and
  of it what torch's caching allocator reserved (the rest is nvCOMP's, KvikIO's, modules loading),
  and peak extra host RSS (pinned staging included) over the memory in use before the save;
* for asyncckpt, the snapshot mode that ran and why;
* for ``asyncckpt:...:delta`` methods, the stored ratio and where the delta references are held
  (GPU or pinned host bytes); their training time lost also counts the steps that ran until the
  reference memory the save asked for was allocated.

A method name ending ``+preallocate`` calls ``preallocate(state)`` and waits for it before its first save.
Checkpoints are deleted after each save (a 64 GB disk holds two 28 GB checkpoints at most), except
a delta method's full saves: the next saves are deltas against them (``delta_reference="full"``),
so the disk holds the base and one delta; retention (``keep_last=1``) deletes a full save once a
newer full save commits, and the method's directory is deleted when it is done.
Progress goes to stderr; the report to ``--out`` as ``full_gpu-<stamp>-<gpu>.json`` and ``.md``.
``--tiny`` is the CPU smoke test. ``--chart JSON`` draws the chart of an existing report (where
matplotlib is installed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncckpt._manifest import read_manifest
from benchmarks.common import (
    BarProgress,
    MemorySampler,
    Progress,
    Workload,
    WorkloadConfig,
    describe_machine,
    fmt_bytes,
    fmt_seconds,
    path_bytes,
    release_memory,
    remove,
    report_head,
    result_name,
    tensor_bytes,
    train_while_saving,
    write_report,
)
from benchmarks.methods import Asyncckpt, Unavailable, build_method
from benchmarks.probes import storage_pass

DEFAULT_SIZES = "2560x13,4096x14"
"""1.0B and 2.8B parameters (33.9 GB of weights and AdamW moments, the issue's setup)."""
DEFAULT_METHODS = "asyncckpt:auto:auto,asyncckpt:fence:auto,asyncckpt:device:auto,asyncckpt:host:auto,dcp.async_save"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.full_gpu", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="WIDTHxLAYERS,... (default: %(default)s)")
    p.add_argument("--methods", default=DEFAULT_METHODS)
    p.add_argument("--gpu-free-gb", type=float, default=10.0, help="GPU memory left free by the filler")
    p.add_argument("--saves", type=int, default=2, help="saves per asyncckpt method (the first allocates)")
    p.add_argument("--preallocate", action="store_true", help="also run asyncckpt:auto:auto with preallocate_for")
    p.add_argument("--scratch", type=Path, default=Path(os.environ.get("BENCH_SCRATCH", ".bench-scratch")))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--tiny", action="store_true", help="CPU-sized smoke test")
    p.add_argument("--batch", type=int, help="sequences per step (default 8; 4 with --tiny)")
    p.add_argument("--context", type=int, help="tokens per sequence (default 128; 64 with --tiny). A larger step "
                   "hides more of a fence behind its forward and backward")  # fmt: skip
    p.add_argument("--chart", type=Path, help="draw the chart of this JSON report and exit")
    return p.parse_args(argv)


def fill_gpu(device: torch.device, leave_bytes: int) -> torch.Tensor | None:
    """Allocate (and hold) GPU memory until ``leave_bytes`` are free; what training would occupy."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    take = free - leave_bytes
    return torch.empty(take, dtype=torch.uint8, device=device) if take > 0 else None


REPORTED_DETAILS = ("snapshot_mode", "snapshot_reason", "io_mode", "gate_seconds", "spilled_bytes", "compress_notes",
                    "result_raw_bytes", "reference_device_bytes", "reference_host_bytes", "specs")  # fmt: skip
"""What a row keeps of an asyncckpt save's details (``specs``: tensors per codec spec the GPU compressor
kept; the same state has stored 1.19x or 1.30x from run to run, by which spec won)."""


def checkpoint_state(work: Workload) -> dict[str, Any]:
    return {"model": work.model.state_dict(), "optim": work.optimizer.state_dict(), "step": work.steps_done}


def measure_save(method: Any, work: Workload, step: int, baseline: float, sampler: MemorySampler) -> dict[str, Any]:
    """One save while training continues: what it cost until durable."""
    work.step()  # the state to save is one step newer than the last save's
    if work.device.type == "cuda":
        torch.cuda.synchronize(work.device)
    gpu_before, host_before = sampler.reset()
    torch_before, torch_live_before = torch_peaks(work.device, reset=True)
    settled = method.settled() if isinstance(method, Asyncckpt) else None
    pending, cost = train_while_saving(work, lambda: method.save(step, checkpoint_state(work)), baseline, settled)
    finished = pending.finish()
    gpu_peak, host_peak = sampler.peaks()
    torch_peak, torch_live_peak = torch_peaks(work.device)
    row = {
        **cost,
        "durable_seconds": finished.durable_seconds,
        "stored_bytes": path_bytes(finished.path),
        "extra_gpu_bytes": max(0, gpu_peak - gpu_before),
        # torch's caching allocator alone (training's and the save's tensors); the driver-reported
        # figure above less this is what others allocated: nvCOMP, KvikIO, CUDA modules loading.
        "extra_gpu_torch_bytes": max(0, torch_peak - torch_before),
        # Of that, what live tensors peaked at: the rest is memory the allocator cached but could not
        # reuse (blocks cached for another stream, or split to other sizes).
        "extra_gpu_torch_live_bytes": max(0, torch_live_peak - torch_live_before),
        "extra_host_bytes": max(0, host_peak - host_before),
        "host_rss_before_bytes": host_before,
        **{k: v for k, v in finished.details.items() if k in REPORTED_DETAILS},
    }
    if not (isinstance(method, Asyncckpt) and method.delta) or read_manifest(finished.path).reference is not None:
        remove(finished.path)  # a full save of a delta chain stays: the next saves are deltas against it
    return row


def torch_peaks(device: torch.device, reset: bool = False) -> tuple[int, int]:
    """Peak bytes torch's caching allocator reserved on ``device``, and peak bytes of live tensors,
    since the last reset (then restarted from now, with ``reset``); zeros off the GPU."""
    if device.type != "cuda":
        return 0, 0
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return int(torch.cuda.max_memory_reserved(device)), int(torch.cuda.max_memory_allocated(device))


def step_live_bytes(work: Workload) -> int:
    """What one training step's own tensors (activations, gradients) add to torch's live bytes at
    their peak: the part of a save row's live figure that is training's, not the save's."""
    if work.device.type != "cuda":
        return 0
    torch.cuda.synchronize(work.device)
    _, before = torch_peaks(work.device, reset=True)
    work.step()
    torch.cuda.synchronize(work.device)
    return max(0, torch_peaks(work.device)[1] - before)


def disk_short_for(scratch: Path, rows: list[dict[str, Any]]) -> str:
    """Why the next save of a delta method, whose earlier saves are ``rows``, would not fit the disk
    under ``scratch`` ('' if it would): its full saves stay on disk as the chain's base, and the next
    save, at most a full one, is written beside the last of them before anything is deleted."""
    stored = [r["stored_bytes"] for r in rows if "stored_bytes" in r]
    if not stored:
        return ""
    free = shutil.disk_usage(scratch).free
    if free >= max(stored):
        return ""
    return (f"not taken: the disk under {scratch} has {fmt_bytes(free)} free beside the chain's base, "
            f"and a save may store {fmt_bytes(max(stored))}")  # fmt: skip


def summary(row: dict[str, Any]) -> str:
    return (
        f"call {fmt_seconds(row['call_seconds'])}, fence held {fmt_seconds(row.get('gate_seconds'))}, "
        f"lost {fmt_seconds(row['lost_seconds'])}, durable {fmt_seconds(row['durable_seconds'])}, "
        f"extra GPU {fmt_bytes(row['extra_gpu_bytes'])}, host {fmt_bytes(row['extra_host_bytes'])}, "
        f"mode {row.get('snapshot_mode', '-')}{references_note(row)}"
        + (f"; specs {row['specs']}" if row.get("specs") else "")
    )


def run_size(args: argparse.Namespace, width: int, layers: int, progress: Progress,
             measured: Callable[[dict[str, Any]], None]) -> dict[str, Any]:  # fmt: skip
    """Every method's saves at one model size; ``measured(result so far)`` after each method."""
    context = args.context or (64 if args.tiny else 128)
    config = WorkloadConfig(width=width, layers=layers, context=context, batch=args.batch or (4 if args.tiny else 8))
    work = Workload(config)
    device = work.device
    for _ in range(3):
        work.step()  # AdamW creates its moments at the first step
    state_bytes = tensor_bytes(checkpoint_state(work))
    progress.say(f"{width}x{layers}: {work.parameters / 1e9:.2f}B parameters, {fmt_bytes(state_bytes)} to checkpoint")
    baseline = statistics.median(work.step() for _ in range(5))
    filler = fill_gpu(device, int(args.gpu_free_gb * 1e9))
    free_after_fill = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    baseline = statistics.median([baseline, *(work.step() for _ in range(3))])
    step_live = step_live_bytes(work)
    progress.say(f"baseline step {fmt_seconds(baseline)} (its live tensors {fmt_bytes(step_live)}); "
                 f"GPU free {fmt_bytes(free_after_fill)}")  # fmt: skip
    sampler = MemorySampler(device)
    rows: list[dict[str, Any]] = []
    result = {"width": width, "layers": layers, "parameters": work.parameters, "state_bytes": state_bytes,
              "baseline_step_seconds": baseline, "gpu_free_after_fill_bytes": free_after_fill,
              "step_live_bytes": step_live, "batch": config.batch, "context": config.context,
              "rows": rows}  # fmt: skip
    step = 0
    names = args.methods.split(",") + (["asyncckpt:auto:auto+preallocate"] if args.preallocate else [])
    for name in names:
        preallocate = name.endswith("+preallocate")
        try:
            method = build_method(name.removesuffix("+preallocate"))
            method.open(args.scratch / f"{width}x{layers}")
        except Unavailable as exc:
            rows.append({"method": name, "unavailable": str(exc)})
            continue
        saves = args.saves if name.startswith("asyncckpt") else 1
        try:
            if preallocate:
                assert isinstance(method, Asyncckpt) and method.checkpointer is not None
                method.checkpointer.preallocate(checkpoint_state(work)).join()
            for k in range(saves):
                step += 1
                chain = isinstance(method, Asyncckpt) and method.delta
                short = disk_short_for(args.scratch, rows[-k:]) if k and chain else ""
                if short:
                    row = {"method": name, "save": k + 1, "error": short}
                else:
                    try:
                        row = {"method": name, "save": k + 1, **measure_save(method, work, step, baseline, sampler)}
                    except Exception as exc:  # noqa: BLE001 - a failed method is a result (e.g. out of memory)
                        row = {"method": name, "save": k + 1, "error": f"{type(exc).__name__}: {exc}"[:400]}
                rows.append(row)
                measured(result)  # after every save too: a time limit keeps what ran
                if isinstance(progress, BarProgress):
                    progress.advance()
                progress.say(f"{width}x{layers} {name} save {k + 1}: {row.get('error') or summary(row)}")
        finally:
            try:
                method.close()
            except Exception as exc:  # noqa: BLE001 - a failed save is re-raised at close; its row has it already
                progress.say(f"{width}x{layers} {name}: close raised {type(exc).__name__}: {exc}"[:400])
            if isinstance(method, Asyncckpt) and method.delta:
                remove(method.directory)
            release_memory(device)
            measured(result)
    sampler.close()
    del filler
    del work
    release_memory(device)
    return result


def stored_cell(row: dict[str, Any]) -> str:
    """Stored bytes, with the ratio where the checkpointer reported the raw bytes."""
    raw = row.get("result_raw_bytes")
    ratio = f" ({raw / row['stored_bytes']:.3f}x)" if raw and row["stored_bytes"] else ""
    return fmt_bytes(row["stored_bytes"]) + ratio


def torch_share(row: dict[str, Any]) -> str:
    """`` (x torch, y live)``: how much of a GPU row's extra memory torch's allocator reserved, and how
    much of that its live tensors peaked at ('' on the CPU)."""
    torch_bytes = row.get("extra_gpu_torch_bytes")
    if not torch_bytes:
        return ""
    live = row.get("extra_gpu_torch_live_bytes")
    live_note = f", {fmt_bytes(live)} live" if live is not None else ""
    return f" ({fmt_bytes(torch_bytes)} torch{live_note})"


def references_note(row: dict[str, Any]) -> str:
    """Where a delta method's references were held after the save ('' with delta off)."""
    if "reference_device_bytes" not in row:
        return ""
    on_gpu, on_host = row["reference_device_bytes"], row.get("reference_host_bytes", 0)
    return f"; refs {fmt_bytes(on_gpu)} GPU, {fmt_bytes(on_host)} host"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Checkpointing a nearly full GPU",
        "",
        f"{report['when']}, {report['machine'].get('gpu') or 'CPU'}; {report['versions_line']}.",
        f"GPU filled until {report['gpu_free_gb']} GB were free; disk wrote "
        f"{fmt_bytes(report['disk_bytes_per_second'])}/s "
        "(one sequential write + fsync, same run). Command: `" + report["command"] + "`.",
        "",
    ]
    for size in report["sizes"]:
        lines += [
            f"## {size['parameters'] / 1e9:.2f}B parameters ({size['width']}x{size['layers']}), "
            f"{fmt_bytes(size['state_bytes'])} of weights + AdamW state; baseline step "
            f"{fmt_seconds(size['baseline_step_seconds'])}"
            + (f" at {size['batch']} x {size['context']} tokens" if size.get("batch") else "")
            + (
                f" (a step's own live tensors: {fmt_bytes(size['step_live_bytes'])})"
                if size.get("step_live_bytes")
                else ""
            ),
            "",
            "| method | save | save() call | fence held | training time lost | durable | stored "
            "| extra GPU (of it torch's) | extra host | mode |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in size["rows"]:
            if "unavailable" in r or "error" in r:
                lines.append(f"| {r['method']} | {r.get('save', '-')} | {r.get('unavailable') or r['error']} |||||||| ")
                continue
            lines.append(
                f"| {r['method']} | {r['save']} | {fmt_seconds(r['call_seconds'])} "
                f"| {fmt_seconds(r.get('gate_seconds'))} | {fmt_seconds(r['lost_seconds'])} "
                f"| {fmt_seconds(r['durable_seconds'])} | {stored_cell(r)} "
                f"| {fmt_bytes(r['extra_gpu_bytes'])}{torch_share(r)} | {fmt_bytes(r['extra_host_bytes'])} "
                f"| {r.get('snapshot_mode', '-')}{references_note(r)} |"
            )
        reasons = {r.get("snapshot_reason") for r in size["rows"] if r.get("snapshot_reason")}
        lines += ["", *(f"- mode chosen: {why}" for why in sorted(reasons)), ""]
    return "\n".join(lines) + "\n"


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(report["sizes"]), figsize=(6 * len(report["sizes"]), 4), squeeze=False)
    for ax, size in zip(axes[0], report["sizes"], strict=True):
        rows = [r for r in size["rows"] if "lost_seconds" in r]
        labels = [f"{r['method'].replace('asyncckpt:', '')} #{r['save']}" for r in rows]
        ax.barh(labels, [r["lost_seconds"] for r in rows], color=["#888" if "dcp" in r["method"] else "#2a7"
                                                                   for r in rows])  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("training time lost per checkpoint (s, log)")
        ax.set_title(f"{size['parameters'] / 1e9:.1f}B params, {fmt_bytes(size['state_bytes'])}, "
                     f"{report['gpu_free_gb']} GB free")  # fmt: skip
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.chart is not None:
        import json

        chart(json.loads(args.chart.read_text()), args.chart.with_suffix(".png"))
        print(args.chart.with_suffix(".png"))
        return 0
    progress = BarProgress()
    if args.tiny:
        args.sizes, args.gpu_free_gb = "64x2", 0.0
        if not torch.cuda.is_available():
            args.methods = "asyncckpt:host:auto,asyncckpt:host:auto:delta,dcp.async_save"
    args.scratch.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    disk = storage_pass(args.scratch, (64 << 20) if args.tiny else (4 << 30))["write_bytes_per_second"]
    progress.say(f"disk: {fmt_bytes(disk)}/s write + fsync")
    machine = describe_machine(args.scratch)
    report: dict[str, Any] = {
        **report_head("python -m benchmarks.full_gpu", sys.argv[1:] if argv is None else argv, machine),
        "gpu_free_gb": args.gpu_free_gb,
        "disk_bytes_per_second": disk,
        "sizes": [],
    }
    name = result_name("full_gpu", machine, args.tiny)
    methods = args.methods.split(",") + (["preallocate"] if args.preallocate else [])
    per_size = sum(args.saves if m.startswith("asyncckpt") or m == "preallocate" else 1 for m in methods)
    progress.start_bar("saves measured", per_size * len(args.sizes.split(",")), unit="saves")
    for size in args.sizes.split(","):
        width, layers = (int(x) for x in size.split("x"))
        done = list(report["sizes"])

        def measured(partial: dict[str, Any], done: list[dict[str, Any]] = done) -> None:
            report["sizes"] = [*done, partial]  # after every method: a time limit keeps what ran
            write_report(args.out, name, report, markdown(report))

        run_size(args, width, layers, progress, measured)
    progress.close_bar()
    print(markdown(report))
    try:
        chart(report, args.out / f"{name}.png")
    except ImportError:
        progress.say("matplotlib is not installed: no chart (python -m benchmarks.full_gpu --chart JSON draws it)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
