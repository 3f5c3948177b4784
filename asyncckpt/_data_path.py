"""The parts of one checkpointer's data path: stager (snapshot), encoder, storage.

Built by :func:`asyncckpt._backend.build_backend` (CPU) or :func:`asyncckpt._gpu.backend.build_gpu_backend`;
this module imports only the plug-in protocols, so both can use it without importing each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._codecs.base import Encoder
from ._snapshot.base import Stager
from ._storage.base import Storage

if TYPE_CHECKING:
    from ._delta_encode import DeltaWriter

log = logging.getLogger("asyncckpt")


@dataclass
class Backend:
    stager: Stager
    encoder: Encoder
    storage: Storage
    snapshot_mode: str
    """The mode of the latest save (the GPU stager decides per save)."""
    snapshot_reason: str = "CPU tensors are staged in host memory"
    """Why that mode ran, for ``SaveResult.snapshot_reason``."""
    delta: DeltaWriter | None = None
    """Incremental saves' policy and reference store (None: ``delta="off"``); its store lives
    where this data path's tensors do (host memory on the CPU path, GPU memory first on the GPU path)."""

    def set_snapshot_mode(self, mode: str, reason: str) -> None:
        """Record the mode a save runs in; logged when it changes. Training thread."""
        if (mode, reason) != (self.snapshot_mode, self.snapshot_reason):
            log.info("asyncckpt: snapshot=%s: %s", mode, reason)
        self.snapshot_mode, self.snapshot_reason = mode, reason

    def close(self) -> None:
        self.stager.close()
        self.encoder.close()
        if self.delta is not None:
            self.delta.close()  # after the encoder: no save reads the references any more
