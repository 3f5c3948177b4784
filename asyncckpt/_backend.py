"""Choose the stager, encoder and storage for a checkpointer's options on this machine.

The CPU path (host staging, zstd/none, POSIX) needs nothing optional. Anything that asks for
the GPU (a GPU codec, ``device``/``fence`` snapshots) goes through :mod:`asyncckpt._gpu`, which
imports nvCOMP/KvikIO lazily and fails with the pip line to run when they are missing.
"""

from __future__ import annotations

from ._codecs import Encoder, NoneCodec, ZstdCodec
from ._data_path import Backend
from ._delta_encode import build_delta_writer
from ._snapshot import HostStager
from ._storage import PosixStorage
from .errors import CheckpointError, MissingDependencyError, gpu_extra_hint
from .options import CheckpointOptions

__all__ = ["CPU_ENCODERS", "Backend", "build_backend", "cpu_encoder"]

CPU_ENCODERS = ("auto", "zstd", "none")


def cpu_encoder(options: CheckpointOptions) -> Encoder:
    if options.codec == "none":
        return NoneCodec()
    return ZstdCodec(level=options.zstd_level)


def build_backend(options: CheckpointOptions) -> Backend:
    """Pick the data path. Runs once, on the thread that builds the checkpointer."""
    wants_gpu = options.codec not in CPU_ENCODERS or options.snapshot in ("device", "fence")
    if options.codec == "auto" and not wants_gpu:
        from ._gpu.deps import gpu_path_available  # imports nothing optional on a machine without CUDA

        wants_gpu = gpu_path_available()  # auto means nvCOMP wherever the GPU path can run
    if wants_gpu:
        try:
            from ._gpu.backend import build_gpu_backend
        except ImportError as exc:
            raise MissingDependencyError(
                f"codec={options.codec!r} snapshot={options.snapshot!r} needs the GPU path, which is not "
                f"available: {exc}\nInstall it with:\n{gpu_extra_hint()}"
            ) from exc
        return build_gpu_backend(options)
    if options.snapshot not in ("auto", "host"):
        raise CheckpointError(f"snapshot={options.snapshot!r} needs a CUDA GPU")
    stager = HostStager(slots=options.max_inflight, budget_bytes=options.host_staging_budget_bytes)
    return Backend(stager=stager, encoder=cpu_encoder(options), storage=PosixStorage(), snapshot_mode="host",
                   delta=build_delta_writer(options))  # fmt: skip
