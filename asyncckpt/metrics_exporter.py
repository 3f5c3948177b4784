"""The HTTP endpoint Prometheus scrapes: one per process, on ``metrics_port + LOCAL_RANK``.

Why rank-offset ports and not prometheus_client's multiprocess mode: every torchrun rank is a
separate process with its own checkpointer, so each rank serving its own registry keeps
per-rank figures apart (a slow rank shows as one ``instance``), needs no shared directory,
no environment variable set before ``prometheus_client`` is imported, and no cleanup of
dead processes' files. The price is one scrape target per local rank (ports ``P .. P+N-1``
on each host), which a static config or a ServiceMonitor lists once. docs/metrics.md has
the trade-off in full.

The server runs on a daemon thread started by prometheus_client and outlives the
checkpointer that started it (so the last figures stay scrapable until the process exits).
Starting the same port twice in one process returns the running server; a port held by
another process raises :class:`~asyncckpt.errors.CheckpointError` naming the rank.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import prometheus_client

from .errors import CheckpointError

log = logging.getLogger("asyncckpt")

DEFAULT_ADDR = "0.0.0.0"
"""Listen on every interface: Prometheus scrapes from another host or container."""


@dataclass
class _Exporter:
    port: int
    registry: Any
    server: Any
    thread: threading.Thread


_lock = threading.Lock()
_exporters: dict[int, _Exporter] = {}
"""Running exporters of this process, by the port that was asked for (after the rank offset)."""


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its host: torchrun's ``LOCAL_RANK``, 0 when not launched by it."""
    raw = (os.environ if environ is None else environ).get("LOCAL_RANK", "")
    if raw == "":
        return 0
    try:
        rank = int(raw)
    except ValueError:
        raise CheckpointError(f"LOCAL_RANK={raw!r} is not an integer; cannot offset metrics_port by it") from None
    if rank < 0:
        raise CheckpointError(f"LOCAL_RANK={raw!r} is negative; cannot offset metrics_port by it")
    return rank


def rank_port(base_port: int, environ: Mapping[str, str] | None = None) -> int:
    """The port this process serves on: ``base_port + LOCAL_RANK``; 0 (any free port) stays 0."""
    if base_port == 0:
        return 0
    port = base_port + local_rank(environ)
    if port > 65535:
        raise CheckpointError(
            f"metrics_port {base_port} + LOCAL_RANK {local_rank(environ)} = {port} is not a TCP port; "
            "pick a lower metrics_port"
        )
    return port


def start_exporter(base_port: int, registry: Any = None, addr: str = DEFAULT_ADDR) -> int:
    """Serve ``registry`` (default: prometheus_client's global one) on ``base_port + LOCAL_RANK``.

    Returns the bound port (useful with ``base_port=0``). Idempotent for the same port and
    registry; any thread.

    Raises:
        CheckpointError: the port is in use, or already serves a different registry here.
    """
    registry = prometheus_client.REGISTRY if registry is None else registry
    port = rank_port(base_port)
    with _lock:
        running = _exporters.get(port)
        if running is not None:
            if running.registry is not registry:
                raise CheckpointError(
                    f"metrics port {running.port} already serves another registry in this process; "
                    "give every checkpointer the same registry= or a different metrics_port"
                )
            return running.port
        try:
            server, thread = prometheus_client.start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            raise CheckpointError(
                f"cannot serve Prometheus metrics on {addr}:{port} (metrics_port {base_port} + "
                f"LOCAL_RANK {local_rank()}): {exc}. Another process holds the port: choose another "
                "metrics_port, and leave ports metrics_port..metrics_port+nproc_per_node-1 free for torchrun"
            ) from exc
        bound = int(server.server_port)
        _exporters[port] = _Exporter(port=bound, registry=registry, server=server, thread=thread)
    log.info("asyncckpt: serving Prometheus metrics on http://%s:%d/metrics", addr, bound)
    return bound


def stop_exporter(port: int) -> None:
    """Stop the exporter started for ``port`` (as returned by :func:`start_exporter`); no-op if none."""
    with _lock:
        key = next((asked for asked, e in _exporters.items() if e.port == port), None)
        exporter = _exporters.pop(key) if key is not None else None
    if exporter is not None:
        exporter.server.shutdown()
        exporter.server.server_close()
        exporter.thread.join()
