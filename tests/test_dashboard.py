"""The Grafana dashboard: generated, provisionable, units everywhere, and only asyncckpt's metrics in it.

Whether each query returns data from a real Prometheus is tests/test_prometheus_e2e.py's job;
this file checks the JSON itself against what Grafana file provisioning and the sidecar need.
"""

from __future__ import annotations

import importlib.util
import json
import re
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml
from conftest import REPO
from prometheus_client import CollectorRegistry

import asyncckpt

DASHBOARD = REPO / "grafana" / "dashboards" / "asyncckpt.json"
PROVISIONING = REPO / "grafana" / "provisioning"

# PromQL words that are not metric names (functions, aggregations, keywords) used by the dashboard.
PROMQL_WORDS = {"sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "time",
                "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                "scalar", "vector", "clamp_min", "bool"}  # fmt: skip


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("asyncckpt_grafana_generate", REPO / "grafana" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def targets() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(panel, t) for panel in dashboard()["panels"] for t in panel["targets"]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Sample names (``_created`` aside) of each metric family a real checkpointer exports after a save and a load."""
    registry = CollectorRegistry()
    run = tmp_path_factory.mktemp("dash") / "run"
    with asyncckpt.AsyncCheckpointer(run, registry=registry) as ckpt:
        ckpt.save(1, {"w": torch.randn(100)})
    asyncckpt.load(run)
    return {f.name: {s.name for s in f.samples if not s.name.endswith("_created")} for f in registry.collect()}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label matchers, grouping labels, ranges and variables removed)."""
    text = re.sub(r'"[^"]*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\$\w+", "", text)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return words - PROMQL_WORDS


def test_committed_json_and_configmap_are_what_the_generator_writes() -> None:
    gen = generator()
    assert DASHBOARD.read_text() == gen.dashboard_json(), "run: python grafana/generate.py"
    assert gen.CONFIGMAP_PATH.read_text() == gen.configmap_yaml(gen.dashboard_json()), "run: python grafana/generate.py"


def test_current_schema_and_no_inputs() -> None:
    d = dashboard()
    assert d["schemaVersion"] >= 39
    assert "__inputs" not in d and "__requires" not in d  # file provisioning does not resolve them
    assert d["uid"] == "asyncckpt" and d["id"] is None
    assert "${DS_" not in DASHBOARD.read_text()  # an exported-for-sharing dashboard would reference these


def test_variables_datasource_job_instance_and_price() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert set(variables) == {"datasource", "job", "instance", "gpu_hour_price"}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["multi"] and v["allValue"] == ".*"
        assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert v["definition"] == v["query"]["query"] and v["definition"].endswith(f", {name})")
    assert '{job=~"$job"}' in variables["instance"]["definition"]
    price = variables["gpu_hour_price"]
    assert price["type"] == "textbox" and float(price["query"]) > 0 and price["current"]["value"] == price["query"]


def test_every_panel_has_a_unit_the_datasource_variable_and_a_place() -> None:
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    occupied: set[tuple[int, int]] = set()
    for p in panels:
        assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']}: no unit"
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"], p["title"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & occupied, f"{p['title']} overlaps another panel"
        occupied |= cells


def test_every_query_filters_by_job_and_instance_and_rates_use_rate_interval() -> None:
    for panel, t in targets():
        expr, where = t["expr"], f"{panel['title']} / {t['refId']}"
        selectors = re.findall(r"asyncckpt_\w+(\{[^}]*\})?", expr)
        assert selectors and all('job=~"$job", instance=~"$instance"' in s for s in selectors), where
        ranged = re.findall(r"\b(rate|irate|increase)\(asyncckpt_\w+\{[^}]*\}\[([^\]]+)\]\)", expr)
        assert len(ranged) == expr.count("["), f"{where}: a range outside rate/irate/increase"
        for function, window in ranged:
            allowed = {"$__rate_interval"} if function in ("rate", "irate") else {"$__rate_interval", "$__range"}
            assert window in allowed, f"{where}: {function}(...[{window}])"


def test_queries_name_only_metrics_asyncckpt_exports(exported: dict[str, set[str]]) -> None:
    names = set().union(*exported.values())
    used: set[str] = set()
    for panel, t in targets():
        found = metric_names(t["expr"])
        assert found, f"{panel['title']}: no metric in {t['expr']}"
        assert found <= names, f"{panel['title']}: {sorted(found - names)} not exported"
        used |= found
    for variable in dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            series = re.fullmatch(r"label_values\((.+), \w+\)", variable["definition"])
            assert series is not None and metric_names(series.group(1)) == {"asyncckpt_build_info"}
    # The other way round: the dashboard shows every metric family asyncckpt exports.
    assert all(family_samples & used for family_samples in exported.values()), [
        family for family, family_samples in exported.items() if not family_samples & used
    ]


def test_the_issue_panels_are_there() -> None:
    panels = dashboard()["panels"]

    def exprs(title_part: str) -> str:
        found = [p for p in panels if title_part.lower() in p["title"].lower()]
        assert found, f"no panel titled like {title_part!r}"
        return " ".join(t["expr"] for p in found for t in p["targets"])

    stall = exprs("stall per save")
    assert "histogram_quantile(0.5," in stall and "histogram_quantile(0.95," in stall
    spent_vs_avoided = exprs("spent vs avoided")
    assert "asyncckpt_gpu_idle_seconds_total" in spent_vs_avoided
    assert "asyncckpt_gpu_idle_avoided_seconds_total" in spent_vs_avoided
    assert "$gpu_hour_price" in exprs("money avoided")
    assert "asyncckpt_compression_saved_bytes_total" in exprs("kept off storage")
    assert "asyncckpt_stored_bytes_total" in exprs("compression ratio")
    throughput = exprs("throughput per stage")
    assert all(f'stage="{stage}"' in throughput for stage in ("snapshot", "compress", "write", "fsync"))
    assert "asyncckpt_inflight_saves" in exprs("in-flight")
    assert 'result="failed"' in exprs("failed") and "{{result}}" in json.dumps(panels)
    assert "time() - " in exprs("age of last good checkpoint")
    money = [p for p in panels if "money" in p["title"].lower()]
    assert all(p["fieldConfig"]["defaults"]["unit"].startswith("currency") for p in money)


def test_provisioning_loads_this_dashboard_from_the_compose_mount() -> None:
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())
    assert datasources["apiVersion"] == 1
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["access"] == "proxy" and ds["isDefault"] is True
    prometheus = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert ds["jsonData"]["timeInterval"] == prometheus["global"]["scrape_interval"]  # makes $__rate_interval right

    providers = yaml.safe_load((PROVISIONING / "dashboards" / "asyncckpt.yaml").read_text())
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    mounted_from = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    dashboards_dir = (REPO / "deploy" / mounted_from[provider["options"]["path"]]).resolve()
    assert dashboards_dir == DASHBOARD.parent
    assert (REPO / "deploy" / mounted_from["/etc/grafana/provisioning"]).resolve() == PROVISIONING


def test_metric_name_parser_sees_through_promql() -> None:
    expr = ('sum by (stage) (rate(a_total{job=~"$job", x="y"}[$__rate_interval])) / on() group_left '
            'sum(rate(b_total{result="committed"}[5m])) * $gpu_hour_price + time()')  # fmt: skip
    assert metric_names(expr) == {"a_total", "b_total"}
    assert metric_names("histogram_quantile(0.95, sum by (le) (rate(c_bucket[1m])))") == {"c_bucket"}
