"""What a finished save reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

STAGES = ("snapshot", "compress", "write", "fsync", "commit")


@dataclass(frozen=True)
class SaveResult:
    """The outcome of one ``save()``; all times in seconds, sizes in bytes."""

    step: int
    path: Path | None
    """The committed checkpoint directory; None if the save was skipped."""
    raw_bytes: int = 0
    stored_bytes: int = 0
    stall_seconds: float = 0.0
    """Host time the training thread spent inside ``save()`` (slot wait + snapshot)."""
    stage_seconds: dict[str, float] = field(default_factory=dict)
    """Seconds per stage: snapshot (training thread), compress, write, fsync, commit (worker thread)."""
    io_mode: str = "posix"
    """How bytes reached the file: ``posix``, ``gds`` (GPUDirect Storage) or ``compat`` (KvikIO bounce buffers)."""
    snapshot_mode: str = "host"
    """Where the snapshot was staged: ``host``, ``device`` or ``fence`` (``auto`` resolved)."""
    snapshot_reason: str = ""
    """Why that mode ran: asked for, or what the memory measured at ``save()`` allowed."""
    codecs: dict[str, int] = field(default_factory=dict)
    """Tensors stored per codec name."""
    durable_seconds: float = 0.0
    """Wall time from save() entry until the commit was durable (includes queueing behind earlier saves)."""
    gpu_idle_seconds: float = 0.0
    """Seconds this save kept the GPU from training: ``stall_seconds`` plus GPU time measured on the
    snapshot copy and on fence waits (0 extra on the CPU path). Defined in docs/metrics.md."""
    skipped: bool = False
    notes: tuple[str, ...] = ()
    """How the save degraded from its plan (GPU path: memory ran short while compressing, the host
    staging budget was spent, tensors stored without a delta for want of scratch), one sentence each;
    also logged. Empty when it ran as planned; ``snapshot_reason`` says why its mode was chosen."""

    @property
    def ratio(self) -> float:
        """Compression ratio raw/stored (1.0 for an empty state)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0
