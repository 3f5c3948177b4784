"""Incremental checkpoints: what a delta against the previous checkpoint stores, and what it costs.

Trains the demo model family (TinyGPT, fused AdamW on a GPU, text from the standard library) and
measures two things in one run.

**Ratios** (``--intervals``, default 10,100,1000 steps): after ``--warmup`` steps the state is
kept as the reference; at each interval after it, every tensor of each class (FP32 weights, the
same weights as BF16, Adam's exp_avg and exp_avg_sq) is encoded by the library's ``auto`` encoder
in full, as an XOR delta and as a zigzag integer difference (:mod:`asyncckpt._delta_ops`). Per
class it reports the ratio of each, the ratio when each tensor keeps its smallest form (what the
delta mode stores), the order-0 entropy bound of the delta's byte planes (the ceiling for a coder
that codes each plane's bytes on their own), and the delta path's throughput (transform + encode,
raw bytes per second, device synchronised). ``--precisions autocast,fp32`` runs both a BF16-autocast
and an FP32 training loop (autocast only exists on the GPU here).

**Checkpoints**: the same training run saved ``--save-every`` steps apart by checkpointers side by
side (each with the GPU staging budget a checkpointer alone would get, so none is fenced for want of
another's staging memory): ``delta="off"``, and ``delta="on"`` with each ``--references`` policy
(``delta_reference``: ``full``, deltas against the chain's full save, the default; ``previous``,
against the save before), ``delta_full_every`` = ``--chain``, until the last save is the deepest of
its chain: ``--chain`` saves, one more on the GPU path, where a checkpointer's first save keeps no
references (their memory is allocated after it). Per save the ratio, the training time lost and the
seconds until durable; then each checkpointer's last checkpoint restored and checked bit for bit
against the state saved, with the bytes that restore reads.

    python -m benchmarks.delta --tiny                  # CPU smoke test (CI)
    python -m benchmarks.delta --out benchmarks/results  # on the H200: 1B parameters
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import asyncckpt
from asyncckpt._delta_chain import ChainReader
from asyncckpt._delta_ops import DELTA_OPS, encode_delta
from asyncckpt._layout import checkpoint_name
from asyncckpt._manifest import read_manifest
from asyncckpt.testing.state_compare import clone_state, first_difference

from .common import (
    BarProgress,
    Progress,
    Workload,
    WorkloadConfig,
    describe_machine,
    fmt_bytes,
    fmt_rate,
    fmt_ratio,
    fmt_seconds,
    report_head,
    result_name,
    synchronize,
    train_while_saving,
    write_report,
)
from .compression import library_encoders, plane_entropy
from .methods import reference_bytes, references_settled

CLASSES = ("weights", "weights_bf16", "exp_avg", "exp_avg_sq")
"""Tensor classes measured; the whole state is FP32 weights + both moments (what a checkpoint holds)."""
WHOLE_STATE = ("weights", "exp_avg", "exp_avg_sq")
ENTROPY_SAMPLE_BYTES = 256 << 20


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.delta", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="2560x13", help="WIDTHxLAYERS (default 2560x13: 1.0B parameters)")
    p.add_argument("--warmup", type=int, default=200, help="training steps before the reference state")
    p.add_argument("--intervals", default="10,100,1000", help="steps after the reference, ascending")
    p.add_argument("--precisions", default="autocast,fp32", help="training loops: autocast (BF16) and/or fp32")
    p.add_argument("--chain", type=int, default=3, help="checkpoints in the measured chain (delta_full_every)")
    p.add_argument("--save-every", type=int, default=100, help="training steps between the chain's saves")
    p.add_argument(
        "--preallocate",
        action="store_true",
        help="preallocate() every checkpointer's staging and reference memory before the first save",
    )
    p.add_argument("--references", default="full",
                   help="delta_reference policies to save with beside delta off: full and/or previous")  # fmt: skip
    p.add_argument("--scratch", type=Path, default=Path(".bench-scratch/delta"))
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--tiny", action="store_true", help="CPU-sized smoke test")
    return p.parse_args(argv)


def class_tensors(work: Workload) -> dict[str, list[torch.Tensor]]:
    """The measured classes, each a list of tensors (the BF16 weights are a cast copy)."""
    found = work.tensor_classes()
    weights = found["weights"]
    return {"weights": weights, "weights_bf16": [w.to(torch.bfloat16) for w in weights],
            "exp_avg": found["exp_avg"], "exp_avg_sq": found["exp_avg_sq"]}  # fmt: skip


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def measure_interval(encoder: Any, reference: dict[str, list[torch.Tensor]], current: dict[str, list[torch.Tensor]],
                     device: torch.device) -> dict[str, Any]:  # fmt: skip
    """Per class: raw bytes, stored bytes in full / per delta op / best per tensor, the entropy bound
    of the best op's delta planes, and the delta path's throughput."""
    out: dict[str, Any] = {}
    for cls in CLASSES:
        raw_total, stored = 0, {"full": 0, **{op: 0 for op in DELTA_OPS}, "best": 0}
        delta_seconds = {op: 0.0 for op in DELTA_OPS}
        samples: dict[str, list[torch.Tensor]] = {op: [] for op in DELTA_OPS}
        sampled = 0
        for i, (old, new) in enumerate(zip(reference[cls], current[cls], strict=True)):
            raw, ref, dtype = _bytes(new), _bytes(old), new.dtype
            raw_total += raw.numel()
            sizes = {"full": encoder.encode(raw, dtype, f"{cls}/{i}/full").stored_bytes}
            for op in DELTA_OPS:
                synchronize(device)
                began = time.perf_counter()
                delta = encode_delta(raw, ref, op, dtype)
                sizes[op] = encoder.encode(delta, dtype, f"{cls}/{i}/{op}").stored_bytes
                synchronize(device)
                delta_seconds[op] += time.perf_counter() - began
                if sampled < ENTROPY_SAMPLE_BYTES:
                    samples[op].append(delta[: ENTROPY_SAMPLE_BYTES - sampled].clone())
            sampled += min(raw.numel(), max(0, ENTROPY_SAMPLE_BYTES - sampled))
            for name, size in sizes.items():
                stored[name] += size
            stored["best"] += min(sizes.values())
        planes = current[cls][0].element_size()
        bounds = {op: plane_entropy(torch.cat(s), planes)["bound_ratio_planes"] for op, s in samples.items() if s}
        out[cls] = {
            "raw_bytes": raw_total,
            "stored_bytes": stored,
            "ratio": {name: raw_total / max(1, size) for name, size in stored.items()},
            "entropy_bound_ratio": bounds,
            "delta_bytes_per_second": {op: raw_total / s if s else None for op, s in delta_seconds.items()},
        }
    raw = sum(out[c]["raw_bytes"] for c in WHOLE_STATE)
    out["whole_state"] = {
        "raw_bytes": raw,
        "ratio": {
            name: raw / max(1, sum(out[c]["stored_bytes"][name] for c in WHOLE_STATE))
            for name in out["weights"]["stored_bytes"]
        },
    }
    return out


def run_ratios(args: argparse.Namespace, config: WorkloadConfig, precision: str, progress: Progress) -> dict[str, Any]:
    work = Workload(config)
    work.autocast = work.autocast and precision == "autocast"
    device = work.device
    progress.say(f"ratios, {precision}: {work.parameters / 1e9:.2f}B parameters, {args.warmup} warm-up steps")
    work.train(args.warmup)
    reference = {cls: [t.detach().clone() for t in ts] for cls, ts in class_tensors(work).items()}
    (encoder,) = [
        b.encoder for name, b in library_encoders(device).items() if name == "auto" and not isinstance(b, str)
    ]
    result: dict[str, Any] = {"precision": precision, "parameters": work.parameters, "intervals": {}}
    done = 0
    for interval in (int(x) for x in args.intervals.split(",")):
        work.train(interval - done)
        done = interval
        measured = measure_interval(encoder, reference, class_tensors(work), device)
        result["intervals"][str(interval)] = measured
        whole = measured["whole_state"]["ratio"]
        progress.say(
            f"{precision}, interval {interval}: whole state full {whole['full']:.3f}x, "
            + ", ".join(f"{op} {whole[op]:.3f}x" for op in DELTA_OPS)
            + f", best {whole['best']:.3f}x"
        )
        if isinstance(progress, BarProgress):
            progress.advance()
    result["final_loss"] = work.last_loss
    del work, reference
    return result


def _timed_load(directory: Path, step: int, device: torch.device) -> tuple[Any, float]:
    synchronize(device)
    began = time.perf_counter()
    loaded = asyncckpt.load(directory, step=step, map_location=device)
    synchronize(device)
    return loaded, time.perf_counter() - began


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
"""torch's caching-allocator counters a save may move: a retry (or a cudaFree) synchronises the
device, and with it every stream training runs on."""


def _lone_staging_budget(device: torch.device) -> int | None:
    """The GPU staging budget a checkpointer created now, alone, would give its first save (None off the GPU)."""
    if device.type != "cuda":
        return None
    from asyncckpt._gpu.budget import default_gpu_budget

    return default_gpu_budget(int(torch.cuda.mem_get_info(device)[0]))


def _allocator_counts(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(name, 0)) for name in ALLOCATOR_COUNTS}


def _save_while_training(ckpt: asyncckpt.AsyncCheckpointer, work: Workload, baseline: float) -> dict[str, Any]:
    """One save while training goes on: what it stored, when it was durable, and the training time
    it cost (the call plus each step's time over the baseline until the checkpoint was durable and
    the reference memory it asked for was allocated)."""
    state = {"model": work.model.state_dict(), "optim": work.optimizer.state_dict()}
    synchronize(work.device)
    began = time.perf_counter()
    settled = references_settled(ckpt)  # the GPU path allocates references after a commit
    before = _allocator_counts(work.device)
    handle, cost = train_while_saving(work, lambda: ckpt.save(work.steps_done, state), baseline, settled)
    result = handle.result()
    cost["allocator"] = {name: n - before[name] for name, n in _allocator_counts(work.device).items()}
    return {"step": result.step, "durable_seconds": time.perf_counter() - began, **cost,
            "stored_bytes": result.stored_bytes, "raw_bytes": result.raw_bytes,
            **({"snapshot_mode": result.snapshot_mode} if work.device.type == "cuda" else {}),
            **reference_bytes(ckpt)}  # fmt: skip


def restore_read_bytes(directory: Path, step: int) -> int:
    """Stored bytes a restore of ``step`` reads: each record's blob, and for a delta record its base's
    record of the same file and key, down the chain (followed, and checked, as a load follows it).
    Divided by the disk's read bandwidth, this is the restore's floor on a cold page cache."""
    path = directory / checkpoint_name(step)
    total = 0
    with ChainReader(path, read_manifest(path)) as checkpoint:
        for record in checkpoint.manifest.tensors:
            level, rec = checkpoint, record
            total += rec.stored_bytes
            while rec.delta is not None:
                rec = level.base_record(rec)
                level = level.base()
                total += rec.stored_bytes
    return total


def run_chain(args: argparse.Namespace, config: WorkloadConfig, progress: Progress) -> dict[str, Any]:
    """Saves per checkpointer while training runs (delta off, and on with each ``--references``
    policy), then each one's deepest checkpoint restored."""
    work = Workload(config)
    device = work.device
    work.train(args.warmup)
    baseline = statistics.median(work.step() for _ in range(10))
    modes = ["off", *(r for r in args.references.split(",") if r)]
    dirs = {mode: args.scratch / f"delta-{mode}" for mode in modes}
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    # keep_last=1: retention keeps the bases the last checkpoint needs, and the disk holds no more.
    # One GPU staging budget for all, the default a checkpointer alone would get: by default each reads
    # the memory free at its save, so the second would see the first's arena gone and fence instead,
    # and the comparison would be of snapshot modes, not of delta. The same figure bounds the delta
    # references' GPU memory: read now, before any arena, it is more than a default read later would give.
    budget = _lone_staging_budget(device)
    ckpts = {mode: asyncckpt.AsyncCheckpointer(d, keep_last=1, gpu_staging_budget_bytes=budget, delta="off")
             if mode == "off" else
             asyncckpt.AsyncCheckpointer(d, keep_last=1, gpu_staging_budget_bytes=budget, delta="on",
                                         delta_full_every=args.chain, delta_reference=mode)
             for mode, d in dirs.items()}  # fmt: skip
    saves: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    expected: dict[str, Any] = {}
    try:
        # On the GPU path a checkpointer's first save keeps no references (their memory is allocated
        # after it) unless preallocate() allocated them, so its chain starts at the second save.
        if args.preallocate:
            state = {"model": work.model.state_dict(), "optim": work.optimizer.state_dict()}
            for ckpt in ckpts.values():
                ckpt.preallocate(state).join()
        deferred = any(references_settled(c) is not None for c in ckpts.values())
        saves_count = args.chain + (1 if deferred and not args.preallocate else 0)
        for i in range(saves_count):
            work.train(args.save_every)
            for mode, ckpt in ckpts.items():
                if i == saves_count - 1:  # the deepest checkpoint: kept to check its restore
                    expected[mode] = clone_state({"model": work.model.state_dict(),
                                                  "optim": work.optimizer.state_dict()})  # fmt: skip
                saves[mode].append(_save_while_training(ckpt, work, baseline))
            progress.say(f"save {i + 1}: " + "; ".join(f"{mode} {_cell(saves[mode][-1])}" for mode in modes))
            if isinstance(progress, BarProgress):
                progress.advance()
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    del work
    restores: dict[str, Any] = {}
    for mode in modes:
        step = saves[mode][-1]["step"]
        loaded, seconds = _timed_load(dirs[mode], step, device)
        exact = first_difference(expected[mode], loaded) is None
        restores[mode] = {"step": step, "seconds": seconds, "bit_exact": exact,
                          "read_bytes": restore_read_bytes(dirs[mode], step)}  # fmt: skip
        del loaded
        progress.say(f"restore step {step}, {mode}: {fmt_seconds(seconds)}, bit-exact {exact}")
    for d in dirs.values():
        shutil.rmtree(d, ignore_errors=True)
    return {"saves": saves, "restores": restores, "chain": args.chain, "save_every": args.save_every,
            "baseline_step_seconds": baseline}  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    lines = ["# Incremental (delta) checkpoints", "",
             f"{report['when']}, {report['machine'].get('gpu') or 'CPU'}; {report['versions_line']}. "
             f"Command: `{report['command']}`.", ""]  # fmt: skip
    for run in report["ratios"]:
        lines += [f"## Ratios, {run['precision']} training, {run['parameters'] / 1e9:.2f}B parameters "
                  "(library `auto` on each form; best = each tensor keeps its smallest form)", "",
                  "| interval | class | full | xor | sub | best | entropy bound xor / sub | delta path (sub) |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for interval, measured in run["intervals"].items():
            for cls in (*CLASSES, "whole_state"):
                e = measured[cls]
                bounds = e.get("entropy_bound_ratio", {})
                bound = " / ".join(f"{bounds[op]:.3f}x" for op in DELTA_OPS if op in bounds) or "-"
                rate = e.get("delta_bytes_per_second", {}).get("sub")
                ratios = " | ".join(fmt_ratio(e["ratio"].get(name)) for name in ("full", "xor", "sub", "best"))
                lines.append(f"| {interval} | {cls} | {ratios} | {bound} | {fmt_rate(rate)} |")
        lines.append("")
    chain = report.get("chain")
    if chain:
        lines += _chain_lines(chain)
    return "\n".join(lines) + "\n"


def _cell(row: dict[str, Any]) -> str:
    ratio = row["raw_bytes"] / row["stored_bytes"]
    lost = fmt_seconds(row.get("lost_seconds"))
    if row.get("steps_after_durable"):  # reference memory was still being allocated when it was durable
        lost += f" ({fmt_seconds(row['lost_after_durable_seconds'])} in {row['steps_after_durable']} steps after)"
    cell = f"{ratio:.3f}x, {lost}, {fmt_seconds(row['durable_seconds'])}"
    if "snapshot_mode" in row:  # the GPU path's: the CPU path always stages on the host
        cell += f", {row['snapshot_mode']}"
    if "reference_device_bytes" in row:
        on_gpu, on_host = row["reference_device_bytes"], row.get("reference_host_bytes", 0)
        cell += f"; refs {fmt_bytes(on_gpu)} GPU, {fmt_bytes(on_host)} host"
    return cell


MODE_TITLES = {"off": "delta off", "full": "delta against the full save", "previous": "delta against the save before"}


def _chain_lines(chain: dict[str, Any]) -> list[str]:
    modes = list(chain["saves"])
    steps = {mode: [row["step"] for row in rows] for mode, rows in chain["saves"].items()}
    lines = [
        f"## Checkpoints while training: {len(chain['saves']['off'])} saves, a full one every {chain['chain']} "
        f"(baseline step {fmt_seconds(chain.get('baseline_step_seconds'))})",
        "",
        "Saved at training steps "
        + "; ".join(f"{mode} {', '.join(map(str, s))}" for mode, s in steps.items())
        + f": {chain['save_every']} steps apart plus the steps that ran while the earlier saves persisted.",
        "",
        "Each cell: ratio, training time lost (of it, the part lost after the checkpoint was durable, while "
        "reference memory was allocated), durable; on the GPU path, the snapshot mode and the reference memory "
        "held after it.",
        "",
        "| save | " + " | ".join(MODE_TITLES.get(mode, mode) for mode in modes) + " |",
        "|---" * (len(modes) + 1) + "|",
    ]
    for i, rows in enumerate(zip(*(chain["saves"][mode] for mode in modes), strict=True), 1):
        lines.append(f"| {i} | " + " | ".join(_cell(row) for row in rows) + " |")
    r = chain["restores"]
    full = r["off"]
    lines += ["", "Restore of each checkpointer's last checkpoint (the deepest of its chain), against the full one:",
              "",
              "| checkpointer | restore | bit-exact | bytes read | time vs full | bytes vs full |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for mode in modes:
        e = r[mode]
        lines.append(f"| {MODE_TITLES.get(mode, mode)} | {fmt_seconds(e['seconds'])} | {e['bit_exact']} | "
                     f"{fmt_bytes(e['read_bytes'])} | {e['seconds'] / full['seconds']:.2f}x | "
                     f"{e['read_bytes'] / full['read_bytes']:.2f}x |")  # fmt: skip
    lines += ["", "Bytes read are the restore's floor where the disk's read bandwidth bounds it.", ""]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.tiny:
        args.size, args.warmup, args.intervals, args.chain, args.save_every = "64x2", 5, "2,5", 3, 2
    width, layers = (int(x) for x in args.size.split("x"))
    config = WorkloadConfig(width=width, layers=layers, context=32 if args.tiny else 128, batch=2 if args.tiny else 8)
    progress = BarProgress()
    machine = describe_machine(args.scratch)
    precisions = [p for p in args.precisions.split(",") if p]
    report: dict[str, Any] = {**report_head("python -m benchmarks.delta", sys.argv[1:] if argv is None else argv,
                                            machine), "ratios": [], "chain": None}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    args.scratch.mkdir(parents=True, exist_ok=True)
    name = result_name("delta", machine, args.tiny)

    steps: list[Callable[[], None]] = [
        *(lambda p=p: report["ratios"].append(run_ratios(args, config, p, progress)) for p in precisions),
        lambda: report.__setitem__("chain", run_chain(args, config, progress)),
    ]
    progress.start_bar("intervals and saves", len(precisions) * len(args.intervals.split(",")) + args.chain, "steps")
    for run in steps:
        run()
        write_report(args.out, name, report, markdown(report))  # after every part: a time limit keeps what ran
    progress.close_bar()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
