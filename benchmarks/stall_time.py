"""How long each way of checkpointing blocks training: asyncckpt against torch.save and DCP, side by side.

One process, one model, one state, one scratch directory. After a few hundred training steps
on real text, the run measures the machine's limits (storage write/read, D2D/D2H/host copy
bandwidth), then goes round after round through the methods (``baseline`` = training with no
checkpoint), so drift shows in the baseline of every round. Per save it records:

* **blocked**: wall seconds of the save call, with the training stream synchronised before and
  after (a copy queued on it counts; a fence the next optimizer step waits on does not:
  that shows as **next step +**, the first step's excess over the baseline step);
* **durable**: from the save call until the checkpoint is on disk (fsynced, committed);
* the training steps run while the save persists (after the first), against the baseline step time;
* bytes stored, and peak extra GPU and host memory over training alone (sampled every 20 ms).

The first save of every method pays one-time costs (staging arenas, pinned memory); the summary
reports it apart and takes median and p95 over the later saves when there are any. A method that
cannot run here (a missing extra, no GPU) is listed as unavailable with the reason; one that
fails mid-run keeps its error. Output: Markdown on stdout, progress on stderr, and
``<out>/<name>.json``, ``.md``, ``.png``, rewritten after every save so a killed run keeps its figures.

    python -m benchmarks.stall_time                 # the defaults for this machine
    python -m benchmarks.stall_time --tiny          # seconds: the CI smoke test
    python -m benchmarks.stall_time --width 2048 --layers 20 --time-limit 330   # ~1B parameters on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import probes
from .common import (
    BarProgress,
    MemorySampler,
    Progress,
    Workload,
    WorkloadConfig,
    command_line,
    describe_machine,
    fmt_bytes,
    fmt_rate,
    fmt_ratio,
    fmt_seconds,
    machine_label,
    median,
    p95,
    path_bytes,
    release_memory,
    remove,
    result_name,
    sized_workload,
    sync_training_stream,
    tensor_bytes,
    utc_stamp,
    versions,
    write_report,
)
from .methods import (
    BASELINE,
    Method,
    Unavailable,
    build_method,
    default_methods,
    ensure_process_group,
    process_group_store,
)

FORMAT_VERSION = 1
OUTPUT_RESERVE_SECONDS = 15.0
"""Kept back from ``--time-limit`` for closing methods and writing the outputs."""
SIZES = {
    "tiny": {"width": 64, "layers": 1, "context": 32, "batch": 2, "train_steps": 5, "baseline_steps": 3,
             "rounds": 1, "budget": 60.0, "probe_bytes": 8 << 20},
    "gpu": {"width": 2048, "layers": 20, "context": 128, "batch": 16, "train_steps": 200, "baseline_steps": 20,
            "rounds": 5, "budget": 400.0, "probe_bytes": 2 << 30},
    "cpu": {"width": 512, "layers": 4, "context": 64, "batch": 4, "train_steps": 200, "baseline_steps": 10,
            "rounds": 5, "budget": 120.0, "probe_bytes": 256 << 20},
}  # fmt: skip
"""The size and time defaults for ``--tiny``, a GPU and a CPU (what the command line leaves unset)."""


# ------------------------------------------------------------------------------------------------ arguments
def build_parser(prog: str = "python -m benchmarks.stall_time") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (CI): tiny model, one round")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--width", type=int, default=None, help="model width (default: 512 on CPU, 2048 on GPU)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default: 4 on CPU, 20 on GPU)")
    p.add_argument("--heads", type=int, default=0, help="attention heads (default: width/128)")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default: 64 CPU, 128 GPU)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: 4 CPU, 16 GPU)")
    p.add_argument("--train-steps", type=int, default=None, help="training steps before measuring (default 200)")
    p.add_argument("--baseline-steps", type=int, default=None, help="steps per baseline sample (default 10)")
    p.add_argument("--min-steps-after", type=int, default=3, help="training steps after every save, at least")
    p.add_argument("--methods", default="default",
                   help="comma-separated: baseline, torch.save, dcp.save, dcp.async_save, dcp.async_save+zstd, "
                        "dcp.async_save+pinned, asyncckpt:<snapshot>:<codec>, default (= all that apply "
                        "here; the default)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=None, help="rounds over the methods, at most (default 5, tiny 1)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the measuring rounds (default 120 on CPU, 400 on GPU)")  # fmt: skip
    p.add_argument("--time-limit", type=float, default=None,
                   help="end the whole run within this many seconds of its start (rounds that would not fit are "
                        "skipped); use it under an external timeout")  # fmt: skip
    p.add_argument("--probe-bytes", type=int, default=None,
                   help="bytes for the storage probe, twice (default: 256 MB CPU, 2 GB GPU); a quarter for "
                        "the copies")  # fmt: skip
    p.add_argument("--dir", type=Path, default=None, help="scratch directory for checkpoints (default: a temp dir)")
    p.add_argument("--out", type=Path, default=Path("runs/bench"), help="where to write the JSON, Markdown, PNG")
    p.add_argument("--name", default=None, help="output file name stem (default: stall_time-<UTC>-<gpu|cpu>)")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG (no matplotlib needed)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


# ------------------------------------------------------------------------------------------------ the run
class MethodRun:
    """One method's state across rounds: its samples, the memory it keeps between saves, its fate."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.method: Method | None = None if name == BASELINE else build_method(name)
        self.label = "no checkpoint (baseline)" if self.method is None else self.method.label
        self.kind = "baseline" if self.method is None else self.method.kind
        self.samples: list[dict[str, Any]] = []
        self.unavailable: str | None = None
        self.error: str | None = None
        self.opened = False
        self.stuck = False
        self.held_gpu_bytes = 0
        self.held_host_bytes = 0

    @property
    def active(self) -> bool:
        return self.unavailable is None and self.error is None

    def estimate_seconds(self, first_guess: float) -> float:
        walls = [s["wall_seconds"] for s in self.samples]
        return max(walls) if walls else first_guess


class Runner:
    def __init__(self, args: argparse.Namespace, workload: Workload, scratch: Path, progress: Progress) -> None:
        self.args, self.workload, self.scratch, self.progress = args, workload, scratch, progress
        self.device = workload.device
        self.sampler = MemorySampler(self.device)
        self.runs = [MethodRun(name) for name in _method_names(args.methods, self.device.type == "cuda")]
        self.limits: dict[str, Any] = {}
        self.rounds_done = 0
        self.notes: list[str] = []
        self.state_bytes = tensor_bytes(workload.state())
        self.deadline = float("inf")

    # -------------------------------------------------------------- one sample
    def baseline_sample(self, run: MethodRun, round_no: int) -> None:
        release_memory(self.device)
        gpu0, host0 = self.sampler.reset()
        began = time.perf_counter()
        steps = [self.workload.step() for _ in range(self.args.baseline_steps)]
        gpu_peak, host_peak = self.sampler.peaks()
        run.samples.append({"round": round_no, "step_seconds": steps, "wall_seconds": time.perf_counter() - began,
                            "peak_extra_gpu_bytes": max(0, gpu_peak - gpu0),
                            "peak_extra_host_bytes": max(0, host_peak - host0)})  # fmt: skip

    def save_sample(self, run: MethodRun, round_no: int) -> dict[str, Any]:
        method = run.method
        assert method is not None
        release_memory(self.device)
        gpu0, host0 = self.sampler.reset()
        began = time.perf_counter()
        step = self.workload.steps_done
        state = self.workload.state()
        raw_bytes = tensor_bytes(state)
        sync_training_stream(self.device)
        call = time.perf_counter()
        pending = method.save(step, state)
        sync_training_stream(self.device)
        blocked = time.perf_counter() - call
        del state  # the training loop keeps no reference: whatever the method needs, it holds itself
        steps: list[float] = []
        persisting: list[float] = []
        while len(steps) < self.args.min_steps_after or not pending.done():
            if time.perf_counter() > self.deadline:
                run.stuck = True  # its save is still in flight: closing it would wait for it
                raise TimeoutError(f"not durable after {time.perf_counter() - call:.0f} s, at the end of the budget")
            was_pending = not pending.done()
            steps.append(self.workload.step())
            if was_pending and len(steps) > 1:  # the first step is reported on its own (fence waits land there)
                persisting.append(steps[-1])
        finished = pending.finish()
        gpu_peak, host_peak = self.sampler.peaks()
        stored = path_bytes(finished.path)
        remove(finished.path)
        release_memory(self.device)
        gpu1, host1 = self.sampler.current()
        # A synchronous method is durable when its call returns; its own clock misses the synchronisations.
        durable = blocked if method.kind == "sync" else finished.durable_seconds
        sample = {
            "round": round_no, "step": step, "blocked_seconds": blocked, "durable_seconds": durable,
            "first_step_seconds": steps[0], "persist_step_seconds": persisting, "steps_after": len(steps),
            "raw_bytes": raw_bytes, "stored_bytes": stored,
            "peak_extra_gpu_bytes": max(0, gpu_peak - gpu0) + run.held_gpu_bytes,
            "peak_extra_host_bytes": max(0, host_peak - host0) + run.held_host_bytes,
            "held_gpu_bytes": max(0, run.held_gpu_bytes + gpu1 - gpu0),
            "held_host_bytes": max(0, run.held_host_bytes + host1 - host0),
            **finished.details,
        }  # fmt: skip
        run.held_gpu_bytes, run.held_host_bytes = sample["held_gpu_bytes"], sample["held_host_bytes"]
        sample["wall_seconds"] = time.perf_counter() - began
        run.samples.append(sample)
        return sample

    # -------------------------------------------------------------- rounds
    def first_guess_seconds(self, run: MethodRun) -> float:
        """A priori seconds for a method's first save, so a first round does not overrun the time limit:
        its bytes at the measured storage speed, twice (a copy and a write), plus zstd's single thread."""
        if run.method is None:
            return 0.0
        raw = self.state_bytes
        write = self.limits.get("storage", {}).get("write_bytes_per_second") or 200e6
        guess = 2 * raw / write + 2.0
        if "zstd" in run.name and run.name.startswith("dcp"):
            guess += raw / 300e6
        return guess

    def measure(self, budget_seconds: float, on_progress: Any) -> None:
        """Run the rounds; methods stay open (call :meth:`close` after writing the results)."""
        began = time.perf_counter()
        self.deadline = began + budget_seconds
        for round_no in range(1, self.args.rounds + 1):
            ran_any = False
            for run in self.runs:
                if not run.active:
                    continue
                left = budget_seconds - (time.perf_counter() - began)
                guess = run.estimate_seconds(self.first_guess_seconds(run) if not run.samples else 0.0)
                if guess > left:
                    self.progress.say(f"round {round_no}: {run.name} skipped (needs ~{guess:.0f} s, {left:.0f} s left)")
                    continue
                if not run.opened and not self._open(run):
                    on_progress()
                    continue
                # A save or step stuck for minutes leaves its threads' stacks in the log.
                faulthandler.dump_traceback_later(max(120.0, 3 * guess), exit=False)
                try:
                    if run.method is None:
                        self.baseline_sample(run, round_no)
                        line = f"median step {fmt_seconds(median(run.samples[-1]['step_seconds']))}"
                    else:
                        s = self.save_sample(run, round_no)
                        line = (f"blocked {fmt_seconds(s['blocked_seconds'])}, durable "
                                f"{fmt_seconds(s['durable_seconds'])}, {fmt_bytes(s['stored_bytes'])} "
                                f"({s['raw_bytes'] / max(1, s['stored_bytes']):.3f}x)")  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - one method's failure is a result, not the end of the run
                    run.error = f"{type(exc).__name__}: {exc}"
                    self.progress.say(f"round {round_no}: {run.name} FAILED: {run.error}")
                    if not run.stuck:
                        self._close(run)
                    with contextlib.suppress(Exception):
                        release_memory(self.device)
                else:
                    ran_any = True
                    self.progress.say(f"round {round_no}: {run.name}: {line}")
                finally:
                    faulthandler.cancel_dump_traceback_later()
                on_progress()
            self.rounds_done = round_no
            if not ran_any:
                break

    def close(self) -> None:
        """Close every method but one whose save is stuck in flight (closing it would wait for that save)."""
        for run in self.runs:
            if not run.stuck:
                self._close(run)
        self.sampler.close()

    def _open(self, run: MethodRun) -> bool:
        run.opened = True
        if run.method is None:
            return True
        try:
            run.method.open(self.scratch)
        except Exception as exc:  # noqa: BLE001 - MissingDependencyError, CheckpointError, Unavailable, ...
            run.unavailable = f"{type(exc).__name__}: {exc}".strip()
            self.progress.say(f"{run.name}: unavailable here: {run.unavailable.splitlines()[0]}")
            self._close(run)
            return False
        return True

    def _close(self, run: MethodRun) -> None:
        if run.method is not None and run.opened:
            try:
                run.method.close()
            except Exception as exc:  # noqa: BLE001 - recorded with the method
                run.error = run.error or f"on close: {type(exc).__name__}: {exc}"
            directory = getattr(run.method, "directory", None)
            if directory is not None:
                remove(directory)


def _method_names(spec: str, cuda: bool) -> list[str]:
    names: list[str] = []
    for item in (m.strip() for m in spec.split(",")):
        for name in default_methods(cuda) if item == "default" else [item] if item else []:
            if name not in names:
                names.append(name)
    for name in names:
        if name != BASELINE:
            build_method(name)  # reject a misspelt method before training
    if BASELINE not in names:
        names.insert(0, BASELINE)  # every ratio needs the baseline step time
    return names


# ------------------------------------------------------------------------------------------------ summary
def summarize(runs: Sequence[MethodRun], limits: dict[str, Any]) -> list[dict[str, Any]]:
    baseline = next((r for r in runs if r.name == BASELINE), None)
    base_steps = [t for s in baseline.samples for t in s["step_seconds"]] if baseline else []
    base_step = median(base_steps)
    base_gpu = max((s["peak_extra_gpu_bytes"] for s in baseline.samples), default=0) if baseline else 0
    base_host = max((s["peak_extra_host_bytes"] for s in baseline.samples), default=0) if baseline else 0
    write_rate = (limits.get("storage") or {}).get("write_bytes_per_second")
    out = []
    for run in runs:
        entry: dict[str, Any] = {"name": run.name, "label": run.label, "kind": run.kind,
                                 "available": run.unavailable is None, "unavailable": run.unavailable,
                                 "error": run.error, "samples": run.samples}  # fmt: skip
        if run.method is None:
            entry["summary"] = {"step_seconds_median": base_step, "step_seconds_p95": p95(base_steps),
                                "peak_extra_gpu_bytes": base_gpu, "peak_extra_host_bytes": base_host}  # fmt: skip
            out.append(entry)
            continue
        samples = run.samples
        steady = samples[1:] if len(samples) >= 2 else samples
        blocked = [s["blocked_seconds"] for s in steady]
        durable = [s["durable_seconds"] for s in steady]
        stored = median([s["stored_bytes"] for s in samples])
        raw = median([s["raw_bytes"] for s in samples])
        persist = [t for s in steady for t in s["persist_step_seconds"]]
        first_step = median([s["first_step_seconds"] for s in steady])
        persist_step = median(persist)
        summary: dict[str, Any] = {
            "samples": len(samples),
            "blocked_seconds_median": median(blocked), "blocked_seconds_p95": p95(blocked),
            "blocked_seconds_first": samples[0]["blocked_seconds"] if samples else None,
            "durable_seconds_median": median(durable),
            "durable_seconds_first": samples[0]["durable_seconds"] if samples else None,
            "next_step_extra_seconds": (first_step - base_step) if first_step and base_step else None,
            "persist_step_ratio": (persist_step / base_step) if persist_step and base_step else None,
            "persist_steps": len(persist),
            "raw_bytes": raw, "stored_bytes": stored,
            "ratio": (raw / stored) if raw and stored else None,
            "disk_seconds": (stored / write_rate) if stored and write_rate else None,
            "peak_extra_gpu_bytes": max(0, max((s["peak_extra_gpu_bytes"] for s in samples), default=0) - base_gpu),
            "peak_extra_host_bytes": max(0, max((s["peak_extra_host_bytes"] for s in samples), default=0) - base_host),
        }  # fmt: skip
        if summary["disk_seconds"] and summary["durable_seconds_median"]:
            summary["durable_vs_disk"] = summary["durable_seconds_median"] / summary["disk_seconds"]
        idle = [s["gpu_idle_seconds"] for s in steady if "gpu_idle_seconds" in s]
        if idle:
            summary["gpu_idle_seconds_median"] = median(idle)
            last = samples[-1]
            summary["snapshot_mode"], summary["io_mode"] = last.get("snapshot_mode"), last.get("io_mode")
            summary["codecs"] = last.get("codecs")
        entry["summary"] = summary
        out.append(entry)
    return out


def markdown(report: dict[str, Any]) -> str:
    m, model, limits = report["machine"], report["model"], report["limits"]
    storage, copies = limits.get("storage") or {}, limits.get("copies") or {}
    lines = [
        f"### Stall time per checkpoint — {machine_label(m)}",
        "",
        f"{report['created_utc']}, torch {report['versions']['torch']}, asyncckpt {report['versions']['asyncckpt']}"
        f" ({report['versions'].get('git_commit') or 'no git'}). Model: {model['parameters'] / 1e6:.1f}M-parameter "
        f"TinyGPT trained {model['train_steps']} steps on {model['device']}"
        f"{' in BF16 autocast' if model['device'] == 'cuda' else ''}; state {fmt_bytes(model['state_bytes'])} "
        f"(FP32 weights, AdamW moments, gradients). Scratch: {m.get('scratch_filesystem', {}).get('type', '?')}."
        + (f" Load average (1/5/15 min) at start {_load(m.get('load_average_at_start'))}, at end "
           f"{_load(report.get('load_average_at_end'))}." if m.get("load_average_at_start") else ""),
        "",
        f"Limits measured in this run: storage write+fsync {fmt_rate(storage.get('write_bytes_per_second'))}, "
        f"cold-ish read {fmt_rate(storage.get('read_bytes_per_second'))}, host memcpy "
        f"{fmt_rate(copies.get('host_copy_bytes_per_second'))}"
        + (f", D2D {fmt_rate(copies.get('d2d_bytes_per_second'))}, D2H pinned "
           f"{fmt_rate(copies.get('d2h_pinned_bytes_per_second'))}, D2H pageable "
           f"{fmt_rate(copies.get('d2h_pageable_bytes_per_second'))}" if "d2d_bytes_per_second" in copies else "")
        + f". Baseline training step: {fmt_seconds(_baseline(report).get('step_seconds_median'))}"
        + f" (per round, for drift: {_per_round(report)}).",
        "",
        "| method | blocked per save, median (p95) | first save blocked | next step + | durable after "
        "| durable / disk time | steps while persisting | stored (ratio) | peak extra GPU / host | saves |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for entry in report["methods"]:
        s = entry.get("summary") or {}
        if entry["kind"] == "baseline":
            continue
        if not entry["available"] or not entry["samples"]:
            if entry["unavailable"]:
                why = f"unavailable: {entry['unavailable']}"
            else:
                why = f"failed: {entry['error']}" if entry["error"] else "not measured: no time left in the budget"
            lines.append(f"| {entry['label']} | {why.splitlines()[0][:140]} |||||||||")
            continue
        codecs = s.get("codecs")
        label = entry["label"] + (f" [{_codecs(codecs)}]" if codecs else "")
        ratio = s.get("persist_step_ratio")
        lines.append(
            f"| {label} | {fmt_seconds(s['blocked_seconds_median'])} ({fmt_seconds(s['blocked_seconds_p95'])}) "
            f"| {fmt_seconds(s['blocked_seconds_first'])} | {_signed(s.get('next_step_extra_seconds'))} "
            f"| {fmt_seconds(s['durable_seconds_median'])} | {fmt_ratio(s.get('durable_vs_disk'), 2)} "
            f"| {(fmt_ratio(ratio, 2) + ' baseline') if ratio else '-'} "
            f"| {fmt_bytes(s['stored_bytes'])} ({fmt_ratio(s.get('ratio'))}) "
            f"| {fmt_bytes(s['peak_extra_gpu_bytes']) if m.get('gpu') else '-'} / "
            f"{fmt_bytes(s['peak_extra_host_bytes'])} "
            f"| {s['samples']}{' (error)' if entry['error'] else ''} |"
        )  # fmt: skip
    lines += ["", "*blocked*: the save call, training stream synchronised before and after; *next step +*: the "
              "first training step after the save minus the baseline step (fence waits land here); *durable / disk "
              "time*: durable time over the stored bytes' time at the measured write speed; median and p95 over the "
              "saves after each method's first; memory over training alone, sampled every 20 ms."]  # fmt: skip
    failed = [e for e in report["methods"] if e["error"]]
    for entry in failed:
        lines.append(f"\n{entry['name']} failed: {entry['error'].splitlines()[0][:300]}")
    return "\n".join(lines) + "\n"


def _per_round(report: dict[str, Any]) -> str:
    samples: list[dict[str, Any]] = next((e["samples"] for e in report["methods"] if e["kind"] == "baseline"), [])
    return ", ".join(fmt_seconds(median(s["step_seconds"])) for s in samples) or "-"


def _load(values: list[float] | None) -> str:
    return "/".join(f"{v:.1f}" for v in values) if values else "?"


def _baseline(report: dict[str, Any]) -> dict[str, Any]:
    return next((e.get("summary") or {} for e in report["methods"] if e["kind"] == "baseline"), {})


def _signed(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return ("+" if seconds >= 0 else "-") + fmt_seconds(abs(seconds))


def _codecs(codecs: dict[str, int]) -> str:
    return ", ".join(f"{name} x{count}" for name, count in sorted(codecs.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks.stall_time") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    args.command = command_line(prog, argv)
    started = time.perf_counter()
    progress = BarProgress(args.quiet)
    config = sized_workload(args, SIZES)
    cuda = config.resolved_device().type == "cuda"
    _method_names(args.methods, cuda)  # fail on a misspelt method now, not after training
    own_scratch = args.dir is None
    scratch = Path(tempfile.mkdtemp(prefix="asyncckpt-bench-")) if own_scratch else args.dir
    scratch.mkdir(parents=True, exist_ok=True)
    machine = describe_machine(scratch)
    name = args.name or result_name("stall_time", machine, args.tiny)
    args.out.mkdir(parents=True, exist_ok=True)
    progress.say(f"stall-time benchmark on {machine_label(machine)}; scratch {scratch} "
                 f"({machine['scratch_filesystem']['type']}); results {args.out / name}.*")  # fmt: skip
    try:
        with warnings.catch_warnings():
            # DCP warns about single-process use and deprecated defaults; those are not results.
            warnings.simplefilter("ignore")
            return _run(args, config, scratch, machine, name, progress, started)
    finally:
        if own_scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _run(args: argparse.Namespace, config: WorkloadConfig, scratch: Path, machine: dict[str, Any], name: str,
         progress: Progress, started: float) -> int:  # fmt: skip
    workload = Workload(config)
    params = workload.parameters
    state_bytes = tensor_bytes(workload.state())
    progress.say(f"model: {params / 1e6:.1f}M parameters (width {config.width}, {config.layers} layers) on "
                 f"{workload.device}; training {args.train_steps} steps")  # fmt: skip
    # Training may take at most 40% of a time limit: the measurements are the point of the run.
    deadline = started + 0.4 * args.time_limit if args.time_limit is not None else None
    train_seconds = workload.train(args.train_steps, progress, deadline=deadline)
    state_bytes = tensor_bytes(workload.state())
    runner = Runner(args, workload, scratch, progress)
    created_pg = False
    if any(r.name.startswith("dcp") for r in runner.runs):
        try:
            created_pg = ensure_process_group(scratch)
        except (Unavailable, RuntimeError, ValueError) as exc:
            for run in runner.runs:
                if run.name.startswith("dcp"):
                    run.unavailable = f"no process group: {exc}"
    progress.say(f"probing storage ({fmt_bytes(args.probe_bytes)}) and copy bandwidth")
    runner.limits["storage"] = probes.storage_bandwidth(scratch, args.probe_bytes)
    runner.limits["copies"] = probes.copy_bandwidth(workload.device, max(1 << 20, args.probe_bytes // 4))
    progress.say(f"storage write {fmt_rate(runner.limits['storage']['write_bytes_per_second'])}, read "
                 f"{fmt_rate(runner.limits['storage']['read_bytes_per_second'])}; copies "
                 + ", ".join(f"{k.replace('_bytes_per_second', '')} {fmt_rate(v)}"
                             for k, v in runner.limits["copies"].items() if k.endswith("_per_second")))  # fmt: skip
    release_memory(workload.device)
    budget = args.budget
    if args.time_limit is not None:
        budget = min(budget, args.time_limit - (time.perf_counter() - started) - OUTPUT_RESERVE_SECONDS)
    progress.say(f"measuring: up to {args.rounds} round(s) over {len(runner.runs)} methods, {budget:.0f} s budget, "
                 f"state {fmt_bytes(state_bytes)}")  # fmt: skip

    model = {"parameters": params, "state_bytes": state_bytes, "width": config.width, "layers": config.layers,
             "heads": config.resolved_heads(), "context": config.context, "batch": config.batch,
             "device": workload.device.type, "train_steps": workload.steps_done, "train_seconds": train_seconds,
             "final_loss": workload.last_loss}  # fmt: skip

    command = args.command

    def report() -> dict[str, Any]:
        return {"benchmark": "stall_time", "format": FORMAT_VERSION, "created_utc": utc_stamp(),
                "command": command, "tiny": args.tiny, "machine": machine, "versions": versions(),
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "workload": asdict(config), "model": model, "limits": runner.limits,
                "rounds": runner.rounds_done, "budget_seconds": budget,
                "methods": summarize(runner.runs, runner.limits), "notes": runner.notes,
                "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}  # fmt: skip

    def save_partial() -> None:
        data = report()
        write_report(args.out, name, data, markdown(data))

    def measured() -> None:
        if isinstance(progress, BarProgress):
            progress.advance()
        save_partial()

    if isinstance(progress, BarProgress):  # a bar under the progress lines, on a terminal
        progress.start_bar("measured", args.rounds * len(runner.runs), unit="measurements")
    try:
        runner.measure(budget, measured)
        if isinstance(progress, BarProgress):
            progress.close_bar()
        data = report()
        text = markdown(data)
        write_report(args.out, name, data, text)
        if not args.no_chart:
            try:
                from .chart import stall_chart

                stall_chart(data, args.out / f"{name}.png")
            except Exception as exc:  # noqa: BLE001 - the JSON and Markdown are written; say why the PNG is not
                progress.say(f"chart not drawn: {type(exc).__name__}: {exc}")
        print(text)
    finally:
        # Closing can wait for a slow save, and can fail: the results are on disk first.
        runner.close()
        if created_pg:
            import torch.distributed as dist

            dist.destroy_process_group()
            remove(process_group_store(scratch))
    if any(r.error and r.error.startswith("on close") for r in runner.runs):
        save_partial()
    progress.say(f"done in {time.perf_counter() - started:.0f} s: {args.out / name}.json/.md"
                 f"{'' if args.no_chart else '/.png'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
