"""What checkpointing costs a large training job per month, by method: bytes written, idle GPU-hours, money.

The scenario asyncckpt exists for: a 70B-parameter model whose checkpoint holds BF16 weights
(2 bytes/parameter), FP32 Adam moments (8) and BF16 gradients (2) — 840 GB (782 GiB) — written
every 30 minutes by 8 to 128 GPUs to shared storage of 5-10 GB/s, or 15 GB/s with GPUDirect
Storage; and a 405B model on 128 GPUs. Per save and GPU:

* **synchronous** (``torch.save``/``dcp.save``): every GPU waits for the whole write,
  ``checkpoint bytes / storage bandwidth`` (the GPUs share the storage);
* **DCP async** and **asyncckpt**: every GPU is blocked while its shard is staged, at the
  throughput measured by the stall-time benchmark (raw bytes / (blocked seconds + the first
  step's excess over the baseline step, where asyncckpt's fence wait lands)), and then trains
  at the measured slowdown (``persist_step_ratio``, later steps) while the stored bytes drain to
  storage. asyncckpt is costed at its best GPU mode (``fence``, else ``device``), or at its
  ``host`` mode where a shard is larger than the GPU memory a job can spare (``--gpu-staging-gb``).

GPU-hours idle per month = GPUs * seconds lost per save * saves per month / 3600. The measured
inputs (compression ratios per tensor class, staging throughputs, slowdowns) default to the
latest committed results in ``benchmarks/results/`` (GPU results preferred); every one is a flag.
Linear scaling of staging time with shard size assumes a bandwidth-bound copy, which is what
the measured snapshots are (D2D, D2H, or a fence over compression reads).

    python docs/tools/cost_model.py            # or: asyncckpt bench cost
    python docs/tools/cost_model.py --gpu-hour-price 4 --storage-gbps 2,20 --gpus 256

A script of the source checkout, not a module of the wheel: it puts the checkout's root first on
``sys.path`` so that it imports the checkout's ``asyncckpt`` and ``benchmarks`` packages.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import command_line, utc_stamp, write_report  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
PROG = "python docs/tools/cost_model.py"
GB = 1e9
SYNC, DCP_ASYNC, OURS = "synchronous", "DCP async", "asyncckpt"
ASYNCCKPT_PREFERENCE = ("asyncckpt:fence:auto", "asyncckpt:device:auto", "asyncckpt:host:auto")
"""Which measured asyncckpt mode stands for asyncckpt at scale: ``fence`` needs no shard-sized GPU buffer."""


@dataclass(frozen=True)
class Inputs:
    weights_ratio: float
    """Compression ratio of BF16 weights under asyncckpt's ``auto``."""
    moments_ratio: float
    """... of FP32 Adam moments (exp_avg and exp_avg_sq, averaged by bytes)."""
    grads_ratio: float
    """... of BF16 gradients."""
    dcp_zstd_ratio: float
    """DCP's zstd extension on the whole state (only its bytes; its stall is DCP async's)."""
    dcp_stage_bytes_per_second: float
    """Raw bytes per second of training lost to ``dcp.async_save``'s call (its staging copy) and the excess of
    the first step after it, per GPU."""
    ours_stage_bytes_per_second: float
    """The same for asyncckpt (save call + the first step's excess, where a fence wait lands), per GPU."""
    dcp_persist_step_ratio: float
    ours_persist_step_ratio: float
    sources: dict[str, str]
    """Where each measured input came from."""
    ours_host_stage_bytes_per_second: float | None = None
    """asyncckpt's blocked-time rate in ``host`` mode, for shards too large to stage on the GPU (None: as above)."""
    ours_host_persist_step_ratio: float | None = None
    gpu_staging_bytes: float = 40e9
    """GPU memory a training job can spare for staging one shard; larger shards are staged in host memory."""


@dataclass(frozen=True)
class Scenario:
    label: str
    params: float
    gpus: int
    storage_bytes_per_second: float
    gds: bool = False
    weight_bytes: float = 2.0
    """Bytes per parameter of the weights (BF16), the Adam moments (two FP32) and the gradients (BF16)."""
    moment_bytes: float = 8.0
    grad_bytes: float = 2.0


def checkpoint_parts(s: Scenario) -> dict[str, float]:
    """Bytes of each part of the checkpoint: weights, Adam moments, gradients."""
    return {"weights": s.weight_bytes * s.params, "moments": s.moment_bytes * s.params,
            "grads": s.grad_bytes * s.params}  # fmt: skip


def per_save(s: Scenario, i: Inputs) -> dict[str, dict[str, Any]]:
    """Seconds lost per GPU and bytes written, for one save, per method."""
    parts = checkpoint_parts(s)
    raw = sum(parts.values())
    shard = raw / s.gpus
    ours_stored = (parts["weights"] / i.weights_ratio + parts["moments"] / i.moments_ratio
                   + parts["grads"] / i.grads_ratio)  # fmt: skip
    bw = s.storage_bytes_per_second
    # A shard larger than the GPU can spare is staged in pinned host memory (asyncckpt's snapshot="auto" does so).
    on_host = shard > i.gpu_staging_bytes and i.ours_host_stage_bytes_per_second is not None
    ours_rate = i.ours_host_stage_bytes_per_second if on_host else i.ours_stage_bytes_per_second
    ours_ratio = i.ours_host_persist_step_ratio if on_host else i.ours_persist_step_ratio
    out: dict[str, dict[str, Any]] = {
        SYNC: {"stored_bytes": raw, "blocked_seconds": raw / bw, "slowdown_seconds": 0.0, "persist_seconds": 0.0}
    }
    for name, stored, rate, ratio in (
        (DCP_ASYNC, raw, i.dcp_stage_bytes_per_second, i.dcp_persist_step_ratio),
        (OURS, ours_stored, ours_rate, ours_ratio or 1.0),
    ):
        assert rate is not None
        persist = stored / bw
        out[name] = {"stored_bytes": stored, "blocked_seconds": shard / rate, "persist_seconds": persist,
                     "slowdown_seconds": max(0.0, ratio - 1.0) * persist}  # fmt: skip
    out[OURS]["staging"] = "host" if on_host else "gpu"
    for value in out.values():
        value["lost_seconds"] = value["blocked_seconds"] + value["slowdown_seconds"]
    return out


def monthly(s: Scenario, i: Inputs, saves_per_month: float, price: float) -> dict[str, Any]:
    total = sum(checkpoint_parts(s).values())
    row: dict[str, Any] = {"scenario": asdict(s), "checkpoint_bytes": total, "shard_bytes": total / s.gpus}
    for name, v in per_save(s, i).items():
        gpu_hours = s.gpus * v["lost_seconds"] * saves_per_month / 3600
        row[name] = {**v, "bytes_per_month": v["stored_bytes"] * saves_per_month, "gpu_hours_per_month": gpu_hours,
                     "cost_per_month": gpu_hours * price}  # fmt: skip
    return row


# ------------------------------------------------------------------------------------------------ inputs
def latest_result(prefix: str, gpu: bool | None = None, directory: Path = RESULTS_DIR) -> Path | None:
    """The newest committed ``<prefix>-*.json`` (names start with the UTC date): of a GPU run (``gpu=True``),
    of a CPU run (``False``), or of either, GPU runs first (``None``)."""
    if gpu is None:
        return latest_result(prefix, True, directory) or latest_result(prefix, False, directory)
    found = sorted(p for p in directory.glob(f"{prefix}-*.json") if ("-cpu" in p.stem) != gpu)
    return found[-1] if found else None


def measured_defaults(stall_path: Path | None, compression_path: Path | None) -> dict[str, Any]:
    """Inputs read from results files; missing ones are absent from the dict."""
    found: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if compression_path is not None:
        data = json.loads(compression_path.read_text())
        classes = data.get("classes", {})

        def auto_ratio(cls: str) -> float | None:
            entry = classes.get(cls, {}).get("library", {}).get("auto", {})
            return entry.get("ratio")

        for key, cls in (("weights_ratio", "weights_bf16"), ("grads_ratio", "grads_bf16")):
            if auto_ratio(cls):
                found[key], sources[key] = auto_ratio(cls), f"{compression_path.name}: {cls} auto"
        moments = [(classes[c]["sample_bytes"], auto_ratio(c)) for c in ("exp_avg", "exp_avg_sq") if auto_ratio(c)]
        if moments:  # combine by bytes: stored = sum(raw / ratio)
            total = sum(n for n, _ in moments)
            found["moments_ratio"] = total / sum(n / r for n, r in moments)
            sources["moments_ratio"] = f"{compression_path.name}: exp_avg + exp_avg_sq auto"
    if stall_path is not None:
        data = json.loads(stall_path.read_text())
        methods = {m["name"]: m for m in data.get("methods", []) if m.get("available") and m.get("samples")}
        where = f"{stall_path.name}"
        dcp = methods.get("dcp.async_save", {}).get("summary", {})
        if dcp.get("blocked_seconds_median"):
            lost = dcp["blocked_seconds_median"] + max(0.0, dcp.get("next_step_extra_seconds") or 0.0)
            found["dcp_stage_bytes_per_second"] = dcp["raw_bytes"] / lost
            sources["dcp_stage_bytes_per_second"] = f"{where}: dcp.async_save"
            found["dcp_persist_step_ratio"] = dcp.get("persist_step_ratio") or 1.0
            sources["dcp_persist_step_ratio"] = f"{where}: dcp.async_save"
        zstd = methods.get("dcp.async_save+zstd", {}).get("summary", {})
        if zstd.get("ratio"):
            found["dcp_zstd_ratio"], sources["dcp_zstd_ratio"] = zstd["ratio"], f"{where}: dcp.async_save+zstd"
        host = methods.get("asyncckpt:host:auto", {}).get("summary", {})
        if host.get("blocked_seconds_median"):
            lost = host["blocked_seconds_median"] + max(0.0, host.get("next_step_extra_seconds") or 0.0)
            found["ours_host_stage_bytes_per_second"] = host["raw_bytes"] / lost
            found["ours_host_persist_step_ratio"] = host.get("persist_step_ratio") or 1.0
            sources["ours_host_stage_bytes_per_second"] = f"{where}: asyncckpt:host:auto"
        for name in ASYNCCKPT_PREFERENCE:
            ours = methods.get(name, {}).get("summary", {})
            if ours.get("blocked_seconds_median"):
                lost = ours["blocked_seconds_median"] + max(0.0, ours.get("next_step_extra_seconds") or 0.0)
                found["ours_stage_bytes_per_second"] = ours["raw_bytes"] / lost
                found["ours_persist_step_ratio"] = ours.get("persist_step_ratio") or 1.0
                sources["ours_stage_bytes_per_second"] = sources["ours_persist_step_ratio"] = f"{where}: {name}"
                for key in ("weights_ratio", "moments_ratio", "grads_ratio"):  # fallback: the whole state's ratio
                    if key not in found and ours.get("ratio"):
                        found[key], sources[key] = ours["ratio"], f"{where}: {name} (whole state)"
                break
        found["_device"] = data.get("model", {}).get("device")
    found["_sources"] = sources
    return found


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--stall-results", type=Path, default=None, help="stall_time JSON (default: latest committed)")
    p.add_argument("--compression-results", type=Path, default=None, help="compression JSON (default: latest)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--params", type=float, default=70e9, help="model parameters (default 70e9)")
    p.add_argument("--gpus", default="8,16,32,64,128", help="GPU counts, comma-separated")
    p.add_argument("--storage-gbps", default="5,10", help="shared storage bandwidths in GB/s, comma-separated")
    p.add_argument("--gds-gbps", type=float, default=15.0, help="GPUDirect Storage bandwidth row (0: none)")
    p.add_argument("--large-params", type=float, default=405e9, help="the large model's parameters (0: none)")
    p.add_argument("--large-gpus", type=int, default=128)
    p.add_argument("--weight-bytes", type=float, default=2.0, help="bytes per parameter of weights (2: BF16)")
    p.add_argument("--moment-bytes", type=float, default=8.0, help="... of optimizer moments (8: two FP32)")
    p.add_argument("--grad-bytes", type=float, default=2.0, help="... of gradients (2: BF16; 0: not saved)")
    p.add_argument("--saves-per-day", type=float, default=48.0, help="default: every 30 minutes")
    p.add_argument("--days-per-month", type=float, default=30.0)
    p.add_argument("--gpu-hour-price", type=float, default=2.50, help="money per GPU-hour (default 2.50)")
    p.add_argument("--currency", default="$")
    for name, text in (("weights-ratio", "BF16 weights compression ratio"), ("moments-ratio", "Adam moments ratio"),
                       ("grads-ratio", "BF16 gradients ratio"), ("dcp-zstd-ratio", "DCP zstd ratio"),
                       ("dcp-stage-gbps", "dcp.async_save staging GB/s per GPU"),
                       ("ours-stage-gbps", "asyncckpt blocked-time GB/s per GPU"),
                       ("ours-host-stage-gbps", "asyncckpt blocked-time GB/s per GPU in host mode"),
                       ("dcp-persist-step-ratio", "DCP async step time while persisting / baseline"),
                       ("ours-persist-step-ratio", "asyncckpt step time while persisting / baseline")):  # fmt: skip
        p.add_argument(f"--{name}", type=float, default=None, help=f"{text} (default: measured)")
    p.add_argument("--gpu-staging-gb", type=float, default=40.0,
                   help="GPU memory (GB) a job can spare to stage its shard; larger shards stage in host "
                        "memory")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="also write <out>/<name>.json and .md")
    p.add_argument("--name", default="cost_model")
    return p


def resolve_inputs(args: argparse.Namespace) -> tuple[Inputs, list[str]]:
    latest_stall = latest_result("stall_time", directory=args.results_dir)
    latest_compression = latest_result("compression", directory=args.results_dir)
    stall = args.stall_results or latest_stall
    compression = args.compression_results or latest_compression
    measured = measured_defaults(stall, compression)
    sources: dict[str, str] = measured.pop("_sources")
    device = measured.pop("_device", None)
    if (stall, compression) != (latest_stall, latest_compression):
        # A run that measured only some methods (time ran out) borrows the rest from the committed results.
        fallback = measured_defaults(latest_stall, latest_compression)
        for key, source in fallback.pop("_sources").items():
            if key not in measured:
                measured[key], sources[key] = fallback[key], f"{source} (not in the given results)"
    warnings = []
    if device == "cpu":
        warnings.append(f"the stall inputs come from a CPU-only run ({stall.name if stall else '?'}): its staging "
                        "rates are host memory copies and its slowdowns come from compression threads sharing the "
                        "training's CPU cores, so these rows do not describe GPUs; measure on a GPU "
                        "(benchmarks/run_h200.sh) or pass the inputs as flags")  # fmt: skip
    values: dict[str, float] = {}
    flags = {"weights_ratio": args.weights_ratio, "moments_ratio": args.moments_ratio, "grads_ratio": args.grads_ratio,
             "dcp_zstd_ratio": args.dcp_zstd_ratio,
             "dcp_stage_bytes_per_second": args.dcp_stage_gbps * GB if args.dcp_stage_gbps else None,
             "ours_stage_bytes_per_second": args.ours_stage_gbps * GB if args.ours_stage_gbps else None,
             "dcp_persist_step_ratio": args.dcp_persist_step_ratio,
             "ours_persist_step_ratio": args.ours_persist_step_ratio}  # fmt: skip
    optional = {"ours_host_stage_bytes_per_second": args.ours_host_stage_gbps * GB if args.ours_host_stage_gbps
                else None, "ours_host_persist_step_ratio": None}  # fmt: skip
    missing = []
    for key, flag in optional.items():
        if flag is not None:
            values[key], sources[key] = flag, "flag"
        elif key in measured:
            values[key] = measured[key]
    for key, flag in flags.items():
        if flag is not None:
            values[key], sources[key] = flag, "flag"
        elif key in measured:
            values[key] = measured[key]
        elif key == "dcp_zstd_ratio":
            values[key], sources[key] = 1.0, "not measured (1.0)"
        else:
            missing.append("--" + key.replace("_bytes_per_second", "_gbps").replace("_", "-"))
    if missing:
        raise SystemExit(f"cost_model: no measured value for {', '.join(missing)} in {args.results_dir}; "
                         "run the benchmarks or pass the flags")  # fmt: skip
    return Inputs(**values, sources=sources, gpu_staging_bytes=args.gpu_staging_gb * GB), warnings


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    sizes = {"weight_bytes": args.weight_bytes, "moment_bytes": args.moment_bytes, "grad_bytes": args.grad_bytes}
    out = []
    gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    bandwidths = [float(b) for b in args.storage_gbps.split(",") if b.strip()]
    label = f"{args.params / 1e9:.0f}B"
    for g in gpus:
        out += [Scenario(label, args.params, g, bw * GB, **sizes) for bw in bandwidths]
        if args.gds_gbps:
            out.append(Scenario(label, args.params, g, args.gds_gbps * GB, gds=True, **sizes))
    if args.large_params:
        big = f"{args.large_params / 1e9:.0f}B"
        out += [Scenario(big, args.large_params, args.large_gpus, bw * GB, **sizes) for bw in bandwidths]
        if args.gds_gbps:
            out.append(Scenario(big, args.large_params, args.large_gpus, args.gds_gbps * GB, gds=True, **sizes))
    return out


def markdown(report: dict[str, Any]) -> str:
    c = report["currency"]
    i = report["inputs"]
    lines = [
        f"### Checkpointing cost per month — {report['saves_per_month']:.0f} saves/month, "
        f"{c}{report['gpu_hour_price']:.2f} per GPU-hour",
        "",
        *[f"**Warning:** {w}.\n" for w in report["warnings"]],
        f"Inputs: asyncckpt ratios {i['weights_ratio']:.3f}x BF16 weights, {i['moments_ratio']:.3f}x Adam moments, "
        f"{i['grads_ratio']:.3f}x BF16 gradients; per GPU, training blocked at "
        f"{i['dcp_stage_bytes_per_second'] / GB:.3g} GB/s of shard by dcp.async_save and "
        f"{i['ours_stage_bytes_per_second'] / GB:.3g} GB/s by asyncckpt; steps while persisting "
        f"{i['dcp_persist_step_ratio']:.2f}x (DCP) and {i['ours_persist_step_ratio']:.2f}x (asyncckpt) the baseline.",
        "",
        "| model, checkpoint | GPUs (shard/GPU) | storage | TB written/month: sync & DCP / asyncckpt "
        "| GPU-h idle/month: sync | DCP async | asyncckpt | cost/month: sync | DCP async | asyncckpt |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in report["rows"]:
        s = row["scenario"]
        storage = f"{s['storage_bytes_per_second'] / GB:.0f} GB/s{' (GDS)' if s['gds'] else ''}"
        sync, dcp, ours = row[SYNC], row[DCP_ASYNC], row[OURS]
        lines.append(
            f"| {s['label']}, {row['checkpoint_bytes'] / GB:.0f} GB | {s['gpus']} ({row['shard_bytes'] / GB:.3g} GB) "
            f"| {storage} "
            f"| {sync['bytes_per_month'] / 1e12:,.0f} / {ours['bytes_per_month'] / 1e12:,.0f} "
            f"| {sync['gpu_hours_per_month']:,.0f} | {dcp['gpu_hours_per_month']:,.1f} "
            f"| {ours['gpu_hours_per_month']:,.2f} "
            f"| {c}{sync['cost_per_month']:,.0f} | {c}{dcp['cost_per_month']:,.0f} | {c}{ours['cost_per_month']:,.2f}"
            f"{' (host staging)' if ours.get('staging') == 'host' else ''} |"
        )  # fmt: skip
    sources = "; ".join(f"{k} ← {v}" for k, v in report["inputs"]["sources"].items())
    limit = f"{i['gpu_staging_bytes'] / GB:.0f} GB"
    lines += ["", "Staging takes one shard of memory per GPU: `device` mode on the GPU, `fence` the shard's "
              f"compressed size in output buffers, `host` pinned host memory. Shards over {limit} "
              "(`--gpu-staging-gb`) are costed at asyncckpt's measured `host`-mode rate (marked *host staging*).",
              "", f"Sources: {sources}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    inputs, warnings = resolve_inputs(args)
    saves = args.saves_per_day * args.days_per_month
    rows = [monthly(s, inputs, saves, args.gpu_hour_price) for s in scenarios(args)]
    report = {"benchmark": "cost_model", "created_utc": utc_stamp(), "command": command_line(prog, argv),
              "saves_per_month": saves, "gpu_hour_price": args.gpu_hour_price, "currency": args.currency,
              "inputs": asdict(inputs), "warnings": warnings, "rows": rows}  # fmt: skip
    text = markdown(report)
    if args.out is not None:
        write_report(args.out, args.name, report, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
