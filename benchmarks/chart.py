"""The stall-time chart: one PNG, three panels sharing the method axis.

Left: training blocked per save on a log axis (bar: median; dots: every save, hollow for each
method's first). Middle: seconds until durable, with the time the raw state takes at the
measured storage write speed. Right: bytes stored, with the raw state's size. matplotlib with
the Agg backend (no display needed), imported only here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .common import fmt_bytes, fmt_seconds, machine_label

COLORS = {"asyncckpt": "#2a9d5c", "dcp": "#3b6fb6", "torch": "#8a8a8a"}


def _color(name: str) -> str:
    return next((c for prefix, c in COLORS.items() if name.startswith(prefix)), "#555555")


def stall_chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [e for e in report["methods"] if e["kind"] != "baseline" and e["available"] and e["samples"]]
    entries.reverse()  # first method at the top
    labels = [e["label"] for e in entries]
    ys = list(range(len(entries)))
    colors = [_color(e["name"]) for e in entries]
    summaries = [e["summary"] for e in entries]
    model, storage = report["model"], (report["limits"].get("storage") or {})
    raw = model["state_bytes"]

    fig, axes = plt.subplots(1, 3, figsize=(15, 1.6 + 0.5 * max(3, len(entries))), sharey=True,
                             gridspec_kw={"width_ratios": [1.3, 1, 1]})  # fmt: skip
    blocked_ax, durable_ax, bytes_ax = axes

    blocked_all = [max(x["blocked_seconds"], 1e-6) for e in entries for x in e["samples"]] or [1e-3]
    floor = 10 ** math.floor(math.log10(min(blocked_all) / 2))
    for y, e, s, c in zip(ys, entries, summaries, colors, strict=True):
        med = max(s["blocked_seconds_median"] or floor, floor)
        blocked_ax.barh(y, med - floor, color=c, alpha=0.85, left=floor)  # a log axis has no zero: start at floor
        for i, sample in enumerate(e["samples"]):
            blocked_ax.plot(max(sample["blocked_seconds"], floor), y, "o", ms=5, mec="black",
                            mfc="none" if i == 0 else "black", mew=0.8)  # fmt: skip
        right = max([med] + [x["blocked_seconds"] for x in e["samples"]])
        blocked_ax.text(right * 1.4, y, fmt_seconds(s["blocked_seconds_median"]), va="center", fontsize=8)
    blocked_ax.set_xscale("log")
    blocked_ax.set_xlim(floor, max(blocked_all) * 12)
    blocked_ax.set_xlabel("training blocked per save (s, log)")
    blocked_ax.set_title("Training blocked (bar: median; dots: every save, hollow = first)", fontsize=9)

    durable_all = [x["durable_seconds"] for e in entries for x in e["samples"]] or [1.0]
    for y, e, s, c in zip(ys, entries, summaries, colors, strict=True):
        durable_ax.barh(y, s["durable_seconds_median"] or 0, color=c, alpha=0.85)
        for sample in e["samples"]:
            durable_ax.plot(sample["durable_seconds"], y, "o", ms=4, color="black")
        right = max([s["durable_seconds_median"] or 0] + [x["durable_seconds"] for x in e["samples"]])
        durable_ax.text(right + max(durable_all) * 0.03, y, fmt_seconds(s["durable_seconds_median"]), va="center",
                        fontsize=8)  # fmt: skip
    xlabel = "seconds until durable"
    if storage.get("write_bytes_per_second"):
        disk = raw / storage["write_bytes_per_second"]
        durable_ax.axvline(disk, ls="--", color="#c0392b", lw=1)
        xlabel += f"\n(red: the raw state at the measured {storage['write_bytes_per_second'] / 1e9:.2g} GB/s)"
    durable_ax.set_xlim(0, max([*durable_all, 0.0]) * 1.25 or 1.0)
    durable_ax.set_xlabel(xlabel)
    durable_ax.set_title("Time until the checkpoint is durable (median, every save)", fontsize=9)

    unit, scale = ("GB", 1e9) if raw >= 1e9 else ("MB", 1e6)
    for y, s, c in zip(ys, summaries, colors, strict=True):
        stored = s["stored_bytes"] or 0
        bytes_ax.barh(y, stored / scale, color=c, alpha=0.85)
        bytes_ax.text(stored / scale, y, f" {fmt_bytes(stored)} ({(s.get('ratio') or 0):.3f}x)", va="center",
                      fontsize=8)  # fmt: skip
    bytes_ax.axvline(raw / scale, ls="--", color="black", lw=1)
    bytes_ax.set_xlabel(f"{unit} stored")
    bytes_ax.set_xlim(0, raw / scale * 1.45)
    bytes_ax.set_title("Bytes stored (dashed: raw state)", fontsize=9)

    blocked_ax.set_yticks(ys)
    blocked_ax.set_yticklabels(labels, fontsize=9)
    for ax in axes:
        ax.grid(axis="x", alpha=0.3)
    versions = report["versions"]
    fig.suptitle(
        f"Checkpoint stall per method — {machine_label(report['machine'])}; "
        f"{model['parameters'] / 1e6:.3g}M-parameter model, {fmt_bytes(raw)} state; torch {versions['torch']}; "
        f"{report['created_utc'][:10]}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
