"""The metrics exporter: opt-in, one port per local rank, clear errors on clashes, valid exposition."""

from __future__ import annotations

import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import free_ports, run_python
from prometheus_client import CollectorRegistry, generate_latest

import asyncckpt
from asyncckpt.errors import CheckpointError
from asyncckpt.metrics_exporter import rank_port, stop_exporter


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


@pytest.fixture
def started_ports() -> Iterator[list[int]]:
    """Ports of exporters a test started; stopped afterwards so tests don't leak servers."""
    ports: list[int] = []
    yield ports
    for port in ports:
        stop_exporter(port)


def test_importing_and_saving_without_metrics_serves_nothing(run_dir: Path) -> None:
    proc = run_python(
        "import sys, torch, asyncckpt\n"
        "with asyncckpt.AsyncCheckpointer(sys.argv[1]) as c:\n"
        "    c.save(1, {'w': torch.ones(4)})\n"
        "print(sorted(m for m in sys.modules if m.startswith(('prometheus_client', 'asyncckpt.metrics'))))\n",
        str(run_dir),
        env={"ASYNCCKPT_METRICS_PORT": ""},
    )
    assert proc.stdout.strip() == "[]"


def test_metrics_port_is_offset_by_local_rank(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                              started_ports: list[int]) -> None:  # fmt: skip
    base = free_ports(2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    registry = CollectorRegistry()
    with asyncckpt.AsyncCheckpointer(run_dir, metrics_port=base, registry=registry) as ckpt:
        started_ports.append(base + 1)
        ckpt.save(1, {"w": torch.ones(256)})
    text = scrape(base + 1)
    assert 'asyncckpt_saves_total{result="committed"} 1.0' in text
    assert "asyncckpt_raw_bytes_total 1024.0" in text
    with pytest.raises(OSError):
        scrape(base)  # rank 1 does not take rank 0's port


def test_environment_variable_turns_metrics_on(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                               started_ports: list[int]) -> None:  # fmt: skip
    port = free_ports(1)
    monkeypatch.setenv("ASYNCCKPT_METRICS_PORT", str(port))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    registry = CollectorRegistry()
    with asyncckpt.AsyncCheckpointer(run_dir, registry=registry) as ckpt:
        started_ports.append(port)
        ckpt.save(3, {"w": torch.ones(8)})
    assert 'asyncckpt_saves_total{result="committed"} 1.0' in scrape(port)


def test_second_checkpointer_reuses_the_running_exporter(tmp_path: Path, started_ports: list[int]) -> None:
    port = free_ports(1)
    registry = CollectorRegistry()
    with asyncckpt.AsyncCheckpointer(tmp_path / "a", metrics_port=port, registry=registry) as a:
        started_ports.append(port)
        a.save(1, {"w": torch.ones(8)})
    with asyncckpt.AsyncCheckpointer(tmp_path / "b", metrics_port=port, registry=registry) as b:
        b.save(1, {"w": torch.ones(8)})
    assert 'asyncckpt_saves_total{result="committed"} 2.0' in scrape(port)
    with pytest.raises(CheckpointError, match="another registry"):
        asyncckpt.AsyncCheckpointer(tmp_path / "c", metrics_port=port, registry=CollectorRegistry())


def test_port_held_by_another_process_fails_with_the_rank_in_the_message(run_dir: Path) -> None:
    port = free_ports(1)
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", port))
        holder.listen()
        with pytest.raises(CheckpointError, match=rf"{port}.*LOCAL_RANK 0.*metrics_port"):
            asyncckpt.AsyncCheckpointer(run_dir, metrics_port=port, registry=CollectorRegistry())


def test_rank_port_rules() -> None:
    assert rank_port(9400, {}) == 9400
    assert rank_port(9400, {"LOCAL_RANK": "7"}) == 9407
    assert rank_port(0, {"LOCAL_RANK": "3"}) == 0  # any free port: nothing to offset
    with pytest.raises(CheckpointError, match="not an integer"):
        rank_port(9400, {"LOCAL_RANK": "one"})
    with pytest.raises(CheckpointError, match="not a TCP port"):
        rank_port(65535, {"LOCAL_RANK": "1"})


@pytest.mark.prometheus
def test_promtool_accepts_the_exposition(run_dir: Path, promtool_binary: str) -> None:
    registry = CollectorRegistry()
    with asyncckpt.AsyncCheckpointer(run_dir, registry=registry) as ckpt:
        ckpt.save(1, {"w": torch.randn(1000)})
    asyncckpt.load(run_dir)
    exposition = generate_latest(registry)
    proc = subprocess.run([promtool_binary, "check", "metrics"], input=exposition, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    assert proc.stdout.decode().strip() == "" and proc.stderr.decode().strip() == ""  # no lint complaint either
