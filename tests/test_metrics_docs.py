"""docs/metrics.md lists exactly the metrics asyncckpt exports, with their types and labels, by the naming rules."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from conftest import REPO
from prometheus_client import CollectorRegistry

import asyncckpt

DOC = REPO / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(asyncckpt_\w+)` \| (\w+) \|([^|]*)\|", re.MULTILINE)


def exported(run: Path) -> dict[str, tuple[str, set[str]]]:
    """Family name as exposed (``_total`` on counters) -> (type, label names), from a real checkpointer."""
    registry = CollectorRegistry()
    with asyncckpt.AsyncCheckpointer(run, registry=registry) as ckpt:
        ckpt.save(1, {"w": torch.ones(10)})
    asyncckpt.load(run)
    families = {}
    for family in registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels if k not in ("le",)}
        families[name] = (family.type, labels)
    return families


def documented() -> dict[str, tuple[str, set[str]]]:
    rows = ROW.findall(DOC.read_text())
    return {name: (kind, set(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}


def test_docs_list_exactly_the_exported_metrics(tmp_path: Path) -> None:
    assert documented() == exported(tmp_path / "run")


def test_names_follow_the_conventions(tmp_path: Path) -> None:
    for name, (kind, labels) in exported(tmp_path / "run").items():
        assert name.startswith("asyncckpt_"), name
        assert (kind == "counter") == name.endswith("_total"), name
        assert not re.search(r"(_ms|_us|_kb|_mb|_gb|_milliseconds|_percent)(_|$)|:", name), f"{name}: not base units"
        if "seconds" in name or "bytes" in name:
            assert re.search(r"_(seconds|bytes)(_total)?$", name), f"{name}: unit not last"
        assert not labels & {"step", "path", "tensor", "key", "file", "rank"}, f"{name}: unbounded label {labels}"
