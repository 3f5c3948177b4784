"""Write the asyncckpt Grafana dashboard and its Kubernetes ConfigMap from one description.

    python grafana/generate.py          # rewrites grafana/dashboards/asyncckpt.json and
                                        # deploy/k8s/base/grafana-dashboard-configmap.yaml

Edit this file, not the JSON: tests/test_dashboard.py fails when the committed files differ
from what this script writes. Every query filters by the ``job`` and ``instance`` variables;
every rate uses ``$__rate_interval`` (totals over the picked time range use ``$__range``);
every panel sets a unit; the data source is the ``datasource`` variable (no ``__inputs``, so
file provisioning and the Grafana sidecar load it as is). Metric names are those of
asyncckpt/metrics.py, listed in docs/metrics.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_PATH = ROOT / "grafana" / "dashboards" / "asyncckpt.json"
CONFIGMAP_PATH = ROOT / "deploy" / "k8s" / "base" / "grafana-dashboard-configmap.yaml"

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance"'
RATE = "[$__rate_interval]"
RANGE = "[$__range]"


def rate(metric: str, extra: str = "") -> str:
    selector = SEL + (f", {extra}" if extra else "")
    return f"rate({metric}{{{selector}}}{RATE})"


def increase(metric: str, extra: str = "") -> str:
    selector = SEL + (f", {extra}" if extra else "")
    return f"increase({metric}{{{selector}}}{RANGE})"


def target(expr: str, legend: str = "", *, instant: bool = False, table: bool = False) -> dict[str, Any]:
    t: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "range": not instant,
                         "instant": instant}  # fmt: skip
    if table:
        t["format"] = "table"
    return t


def stat(title: str, description: str, unit: str, expr: str, *, decimals: int | None = None,
         red_above: float | None = None) -> dict[str, Any]:  # fmt: skip
    defaults: dict[str, Any] = {"unit": unit, "color": {"mode": "thresholds"}}
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if red_above is not None:
        steps.append({"color": "red", "value": red_above})
    defaults["thresholds"] = {"mode": "absolute", "steps": steps}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {
        "type": "stat", "title": title, "description": description,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "none", "textMode": "auto", "justifyMode": "auto",
                    "orientation": "auto"},
        "targets": [target(expr, instant=True)],
    }  # fmt: skip


def timeseries(title: str, description: str, unit: str, targets: list[dict[str, Any]], *,
               stacked: bool = False, overrides: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                              "spanNulls": True}  # fmt: skip
    if stacked:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "type": "timeseries", "title": title, "description": description,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom, "min": 0}, "overrides": overrides or []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": targets,
    }  # fmt: skip


def panels() -> list[dict[str, Any]]:
    raw, stored = "asyncckpt_raw_bytes_total", "asyncckpt_stored_bytes_total"
    failed, committed = 'result="failed"', 'result="committed"'

    def stage_rate(stage: str) -> str:
        return "sum(" + rate("asyncckpt_stage_seconds_total", f'stage="{stage}"') + ")"

    def stall_q(quantile: float) -> str:
        return f"histogram_quantile({quantile}, sum by (le) ({rate('asyncckpt_save_stall_seconds_bucket')}))"

    top = [
        stat(
            "Age of last good checkpoint",
            "Seconds since the stalest selected rank last committed a save "
            "(a restart resumes from the oldest rank's latest checkpoint).",
            "s",
            f"time() - min(asyncckpt_last_success_timestamp_seconds{{{SEL}}} > 0)",
        ),
        stat(
            "GPU time spent on checkpoints",
            "GPU idle seconds checkpointing caused in the time range, all "
            "selected ranks: save() stall + measured GPU snapshot-copy and fence time.",
            "s",
            f"sum({increase('asyncckpt_gpu_idle_seconds_total')})",
        ),
        stat(
            "GPU time avoided",
            "GPU idle seconds a synchronous save of the same raw bytes would have cost "
            "(at each save's measured write bandwidth), minus what the asynchronous save cost.",
            "s",
            f"sum({increase('asyncckpt_gpu_idle_avoided_seconds_total')})",
        ),
        stat(
            "Money avoided at $gpu_hour_price / GPU-hour",
            "GPU time avoided in the time range, priced at the gpu_hour_price variable (per GPU-hour).",
            "currencyUSD",
            f"sum({increase('asyncckpt_gpu_idle_avoided_seconds_total')}) / 3600 * $gpu_hour_price",
            decimals=2,
        ),
        stat(
            "Bytes compression kept off storage",
            "Raw minus stored bytes of the saves committed in the time range.",
            "bytes",
            f"sum({increase('asyncckpt_compression_saved_bytes_total')})",
        ),
        stat(
            "Compression ratio",
            "Raw bytes / stored bytes of the saves committed in the time range.",
            "suffix:x",
            f"sum({increase(raw)}) / sum({increase(stored)})",
            decimals=3,
        ),
        stat(
            "Failed saves",
            "Saves that failed in the time range (the previous checkpoint stayed the latest).",
            "short",
            f"sum({increase('asyncckpt_saves_total', failed)})",
            red_above=0.5,
        ),
        stat(
            "Mean load time",
            "Mean seconds asyncckpt.load() took in the time range.",
            "s",
            f"sum({increase('asyncckpt_load_seconds_sum')}) / sum({increase('asyncckpt_load_seconds_count')})",
        ),
    ]
    per_save = f"sum({rate('asyncckpt_saves_total', committed)})"
    graphs = [
        timeseries(
            "Training stall per save",
            "Host seconds the training thread was blocked in save() "
            "(histogram: p50 and p95 over all selected ranks; mean from _sum/_count).",
            "s",
            [
                target(stall_q(0.5), "p50"),
                target(stall_q(0.95), "p95"),
                target(
                    f"sum({rate('asyncckpt_save_stall_seconds_sum')}) / "
                    f"sum({rate('asyncckpt_save_stall_seconds_count')})",
                    "mean",
                ),
            ],
        ),
        timeseries(
            "GPU idle time per hour: spent vs avoided",
            "GPU-seconds per hour of wall time, all selected "
            "ranks. Spent: what checkpointing cost. Synchronous equivalent: what saving the raw bytes "
            "synchronously would have cost. Avoided: the difference, per save.",
            "s",
            [
                target(f"sum({rate('asyncckpt_gpu_idle_seconds_total')}) * 3600", "spent"),
                target(f"sum({rate('asyncckpt_gpu_idle_avoided_seconds_total')}) * 3600", "avoided"),
                target(
                    f"sum({rate('asyncckpt_gpu_idle_sync_equivalent_seconds_total')}) * 3600", "synchronous equivalent"
                ),
            ],
        ),
        timeseries(
            "Money avoided per hour at $gpu_hour_price / GPU-hour",
            "Avoided (and spent) GPU time priced at the gpu_hour_price variable, per hour of wall time.",
            "currencyUSD",
            [
                target(f"sum({rate('asyncckpt_gpu_idle_avoided_seconds_total')}) * $gpu_hour_price", "avoided"),
                target(f"sum({rate('asyncckpt_gpu_idle_seconds_total')}) * $gpu_hour_price", "spent"),
            ],
        ),
        timeseries(
            "Bytes checkpointed",
            "Raw (uncompressed) and stored bytes per second of committed saves, "
            "and the bytes compression kept off storage.",
            "Bps",
            [
                target(f"sum({rate(raw)})", "raw"),
                target(f"sum({rate(stored)})", "stored"),
                target(f"sum({rate('asyncckpt_compression_saved_bytes_total')})", "kept off storage"),
            ],
        ),
        timeseries(
            "Compression ratio",
            "Raw / stored bytes of the saves committed in each interval.",
            "suffix:x",
            [target(f"sum({rate(raw)}) / sum({rate(stored)})", "raw / stored")],
        ),
        timeseries(
            "Throughput per stage",
            "Bytes per second of stage time: snapshot and compress over raw bytes, write and fsync over stored bytes.",
            "Bps",
            [
                target(f"sum({rate(raw)}) / {stage_rate('snapshot')}", "snapshot"),
                target(f"sum({rate(raw)}) / {stage_rate('compress')}", "compress"),
                target(f"sum({rate(stored)}) / {stage_rate('write')}", "write"),
                target(f"sum({rate(stored)}) / {stage_rate('fsync')}", "fsync"),
            ],
        ),
        timeseries(
            "Seconds per save by stage",
            "Mean seconds one committed save spent in each stage (snapshot on "
            "the training thread; the rest on the worker thread).",
            "s",
            [
                target(
                    f"sum by (stage) ({rate('asyncckpt_stage_seconds_total')}) / on() group_left {per_save}",
                    "{{stage}}",
                ),
            ],
            stacked=True,
        ),
        timeseries(
            "Saves per minute by result",
            "Committed, failed and skipped (no free in-flight slot) saves.",
            "opm",
            [target(f"sum by (result) ({rate('asyncckpt_saves_total')}) * 60", "{{result}}")],
        ),
        timeseries(
            "In-flight saves",
            "Saves staged and not yet committed or failed, per rank.",
            "short",
            [target(f"sum by (instance) (asyncckpt_inflight_saves{{{SEL}}})", "{{instance}}")],
        ),
        timeseries(
            "Staging memory in use",
            "Bytes of staging memory held by in-flight snapshots, per rank.",
            "bytes",
            [target(f"sum by (instance) (asyncckpt_staging_bytes{{{SEL}}})", "{{instance}}")],
        ),
        timeseries(
            "Age of last good checkpoint per rank",
            "Seconds since each rank last committed a save.",
            "s",
            [target(f"time() - (asyncckpt_last_success_timestamp_seconds{{{SEL}}} > 0)", "{{instance}}")],
        ),
    ]
    info = {
        "type": "table", "title": "Build and I/O path", "description": "asyncckpt_build_info per rank: versions, "
        "the configured codec, and whether the latest save went through GPUDirect Storage (gds), KvikIO "
        "bounce buffers (compat) or POSIX.",
        "fieldConfig": {"defaults": {"unit": "none"}, "overrides": []},
        "options": {"showHeader": True},
        "transformations": [{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True,
                                                                              "__name__": True}}}],
        "targets": [target(f"asyncckpt_build_info{{{SEL}}}", instant=True, table=True)],
    }  # fmt: skip

    laid: list[dict[str, Any]] = []
    for i, panel in enumerate(top):
        laid.append({**panel, "gridPos": {"h": 4, "w": 3, "x": 3 * i, "y": 0}})
    for i, panel in enumerate(graphs):
        laid.append({**panel, "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 4 + 8 * (i // 2)}})
    laid.append({**info, "gridPos": {"h": 6, "w": 24, "x": 0, "y": 4 + 8 * ((len(graphs) + 1) // 2)}})
    for number, panel in enumerate(laid, start=1):
        panel["id"] = number
        panel["datasource"] = DS
        for ref, t in zip("ABCDEFGH", panel["targets"], strict=False):
            t["refId"] = ref
    return laid


def variables() -> list[dict[str, Any]]:
    def label_query(name: str, query: str) -> dict[str, Any]:
        return {
            "name": name, "label": name, "type": "query", "datasource": DS, "definition": query,
            "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2, "sort": 1, "multi": True, "includeAll": True, "allValue": ".*", "regex": "",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "hide": 0,
        }  # fmt: skip

    price = "2.50"
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "regex": "",
         "current": {}, "options": [], "hide": 0, "refresh": 1},
        label_query("job", "label_values(asyncckpt_build_info, job)"),
        label_query("instance", 'label_values(asyncckpt_build_info{job=~"$job"}, instance)'),
        {"name": "gpu_hour_price", "label": "GPU-hour price (USD)", "type": "textbox", "query": price,
         "description": "What one GPU-hour costs you; prices the avoided GPU time.",
         "current": {"selected": False, "text": price, "value": price},
         "options": [{"selected": True, "text": price, "value": price}], "hide": 0},
    ]  # fmt: skip


def dashboard() -> dict[str, Any]:
    return {
        "id": None, "uid": "asyncckpt", "title": "asyncckpt: checkpoint cost and compression",
        "description": "What asynchronous checkpointing costs the GPUs, what it avoided, and what compression saves.",
        "tags": ["asyncckpt", "checkpointing", "pytorch"], "editable": True, "graphTooltip": 1,
        "schemaVersion": 39, "version": 1, "timezone": "browser", "refresh": "30s", "liveNow": False,
        "fiscalYearStartMonth": 0, "weekStart": "",
        "time": {"from": "now-1h", "to": "now"}, "timepicker": {},
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "links": [], "panels": panels(), "templating": {"list": variables()},
    }  # fmt: skip


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def configmap_yaml(dashboard_text: str) -> str:
    """The dashboard as a ConfigMap the Grafana sidecar (kube-prometheus-stack) picks up by its label."""
    body = "".join(f"    {line}\n" if line else "\n" for line in dashboard_text.rstrip("\n").split("\n"))
    return (
        "# Generated by grafana/generate.py from the same description as grafana/dashboards/asyncckpt.json.\n"
        '# The Grafana sidecar loads ConfigMaps labelled grafana_dashboard="1".\n'
        "apiVersion: v1\n"
        "kind: ConfigMap\n"
        "metadata:\n"
        "  name: asyncckpt-grafana-dashboard\n"
        "  labels:\n"
        "    app.kubernetes.io/name: asyncckpt\n"
        '    grafana_dashboard: "1"\n'
        "  annotations:\n"
        "    grafana_folder: asyncckpt\n"
        "data:\n"
        "  asyncckpt.json: |-\n"
        f"{body}"
    )


def main() -> int:
    text = dashboard_json()
    DASHBOARD_PATH.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_PATH.write_text(text)
    CONFIGMAP_PATH.parent.mkdir(parents=True, exist_ok=True)
    CONFIGMAP_PATH.write_text(configmap_yaml(text))
    print(f"wrote {DASHBOARD_PATH.relative_to(ROOT)} and {CONFIGMAP_PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
