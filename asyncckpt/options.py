"""Checkpointer options: a frozen dataclass validated on construction.

Every knob resolves as: explicit argument > ``ASYNCCKPT_<NAME>`` environment variable >
default, so a cluster operator can tune a job without touching its code
(``ASYNCCKPT_MAX_INFLIGHT=2``). An invalid value fails at construction with a message that
says which knob, what was given and what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

WhenBusy = Literal["block", "skip"]
SnapshotMode = Literal["auto", "host", "device", "fence"]
DeltaMode = Literal["off", "on", "auto"]
DELTA_MODES = ("off", "on", "auto")
DeltaReference = Literal["full", "previous"]
DELTA_REFERENCES = ("full", "previous")
MAX_DELTA_FULL_EVERY = 64
"""The longest chain a reader follows (``asyncckpt._delta_chain.MAX_CHAIN_DEPTH``)."""

CODEC_NAMES = ("auto", "none", "zstd", "lz4", "deflate", "ans", "gdeflate", "bitcomp", "cascaded")


@dataclass(frozen=True)
class CheckpointOptions:
    keep_last: int | None = None
    """Committed checkpoints to keep (oldest deleted first); None keeps all."""
    max_inflight: int = 1
    """Saves staged but not yet committed; the next save() applies ``when_busy`` beyond it."""
    when_busy: WhenBusy = "block"
    """``block``: save() waits for a slot (the wait is reported as stall); ``skip``: the save is skipped and counted."""
    codec: str = "auto"
    """``auto`` (zstd on CPU; the smallest of cheap nvCOMP candidates per tensor on GPU), or one codec name."""
    zstd_level: int = 1
    snapshot: SnapshotMode = "auto"
    """Where CUDA tensors are staged: ``host`` (pinned memory), ``device`` (GPU arena), ``fence`` (no copy)."""
    host_staging_budget_bytes: int | None = None
    """Host staging memory allowed for all in-flight saves (raw copies in ``host`` mode, compressed
    bytes a ``fence`` save cannot keep on the GPU); None means half of physical memory divided by
    ``LOCAL_WORLD_SIZE``."""
    gpu_staging_budget_bytes: int | None = None
    """GPU memory a save may use beyond the live state (arena, compressor scratch, compressed bytes
    kept on the GPU), in every mode; None means the staging arena earlier saves allocated plus a
    quarter of the free GPU memory, re-read at every save (:mod:`asyncckpt._gpu.budget`)."""
    io_threads: int = 0
    """Parallel writer threads (KvikIO); 0 picks a default."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (plus the local rank); None serves nothing."""
    delta: DeltaMode = "off"
    """Incremental checkpoints (docs/format.md, :mod:`asyncckpt._delta_encode`): ``off`` (every save
    full), ``on`` (a tensor is stored as a delta against the previous committed save whenever that
    is smaller; costs host memory for one raw copy of the state, within ``host_staging_budget_bytes``),
    ``auto`` (as ``on``, but keys whose delta does not pay are neither tried nor kept in memory until
    the next full save, references share the host budget with staging, and on the GPU path a
    ``fence`` save, whose references could only cross PCIe while training waits, takes no delta)."""
    delta_full_every: int = 4
    """With ``delta``: every this many saves one is full (1: all full); larger values make more saves
    small. With ``delta_reference="previous"`` restoring a step reads up to this many checkpoints
    per tensor; with ``"full"``, at most two."""
    delta_reference: DeltaReference = "full"
    """With ``delta``: what a delta save is encoded against. ``full``: the last full save (a restore
    reads at most two checkpoints per tensor, and a delta save copies no reference; each delta grows
    a little with its distance from that save). ``previous``: the save just before (the smallest
    deltas; a restore reads the whole chain back to its full save). Measured: README.md,
    "Incremental checkpoints"."""

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None (keep all), got {self.keep_last}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.when_busy not in ("block", "skip"):
            raise ValueError(f"when_busy must be 'block' or 'skip', got {self.when_busy!r}")
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"codec must be one of {', '.join(CODEC_NAMES)}; got {self.codec!r}")
        if self.snapshot not in ("auto", "host", "device", "fence"):
            raise ValueError(f"snapshot must be 'auto', 'host', 'device' or 'fence'; got {self.snapshot!r}")
        for name in ("host_staging_budget_bytes", "gpu_staging_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
        if self.io_threads < 0:
            raise ValueError(f"io_threads must be >= 0, got {self.io_threads}")
        if self.delta not in DELTA_MODES:
            raise ValueError(f"delta must be 'off', 'on' or 'auto'; got {self.delta!r}")
        if self.delta_reference not in DELTA_REFERENCES:
            raise ValueError(f"delta_reference must be 'full' (deltas against the chain's full save) or 'previous' "
                             f"(against the save before); got {self.delta_reference!r}")  # fmt: skip
        if type(self.delta_full_every) is not int or not 1 <= self.delta_full_every <= MAX_DELTA_FULL_EVERY:
            raise ValueError(f"delta_full_every must be an int in [1, {MAX_DELTA_FULL_EVERY}] (saves per full "
                             f"checkpoint), got {self.delta_full_every!r}")  # fmt: skip
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be a TCP port (0-65535), got {self.metrics_port}")


def _env_value(name: str, field: dataclasses.Field[Any]) -> Any:
    raw = os.environ.get(f"ASYNCCKPT_{name.upper()}")
    if raw is None or raw == "":
        return dataclasses.MISSING
    annotation = str(field.type)
    if "int" in annotation:
        if raw.lower() in ("none", "all") and "None" in annotation:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"ASYNCCKPT_{name.upper()}={raw!r} is not an integer") from None
    return raw


def resolve_options(**arguments: Any) -> CheckpointOptions:
    """Build options from arguments (``None`` or absent = not given), the environment, then defaults."""
    unknown = set(arguments) - {f.name for f in dataclasses.fields(CheckpointOptions)}
    if unknown:
        raise TypeError(f"unknown checkpointer option(s): {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(CheckpointOptions):
        given = arguments.get(f.name)
        value = given if given is not None else _env_value(f.name, f)
        if value is not dataclasses.MISSING:
            values[f.name] = value
    return CheckpointOptions(**values)
