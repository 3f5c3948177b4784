"""Assemble the GPU data path for a checkpointer: staging, the nvCOMP pipeline, KvikIO storage.

Called by :func:`asyncckpt._backend.build_backend` on the thread that builds the checkpointer,
for the current CUDA device. Fails early, before any save, when CUDA, nvCOMP or KvikIO is
missing (with the pip line to run) or when the options cannot work together.
"""

from __future__ import annotations

import logging

from .._data_path import Backend
from .._delta_encode import build_delta_writer
from ..errors import CheckpointError
from ..options import CheckpointOptions
from .delta_store import DeviceReferenceStore
from .deps import kvikio, nvcomp, require_cuda
from .pipeline import DEFAULT_WINDOW_BYTES, DELTA_SCRATCH_FACTOR, MIN_COMPRESS_BYTES, GpuEncoder
from .staging import GpuStager
from .storage import KvikioStorage

log = logging.getLogger("asyncckpt")

NO_RECORDS = 1 << 62
"""``min_record_bytes`` with ``codec="none"``: nothing is compressed, so nothing is recorded."""


def build_gpu_backend(options: CheckpointOptions) -> Backend:
    nv, kv = nvcomp(), kvikio()  # raise MissingDependencyError (with the pip line) before anything starts
    device = require_cuda(f"codec={options.codec!r} snapshot={options.snapshot!r}")
    if options.snapshot == "fence" and options.codec == "none":
        raise CheckpointError(
            "snapshot='fence' reads the live tensors while it compresses them; with codec='none' "
            "nothing is read before training moves on. Use snapshot='device', or a codec"
        )
    storage = KvikioStorage(device, options.io_threads)
    encoder = GpuEncoder(options.codec, device)
    stager = GpuStager(
        mode=options.snapshot,
        device=device,
        slots=options.max_inflight,
        submit=encoder.submit,
        window_bytes=DEFAULT_WINDOW_BYTES,
        gpu_budget_bytes=options.gpu_staging_budget_bytes,
        host_budget_bytes=options.host_staging_budget_bytes,
        register=storage.register,
        deregister=storage.deregister,
        fence_allowed=options.codec != "none",
    )
    encoder.delta = build_delta_writer(
        options,
        lambda host_budget: DeviceReferenceStore(device, host_budget, stream=encoder.stream),
    )
    if encoder.delta is not None:
        stager.forms_per_tensor = DELTA_SCRATCH_FACTOR
        stager.delta_auto = options.delta == "auto"
        store = encoder.delta.store
        if isinstance(store, DeviceReferenceStore):  # references are recorded only for what is compressed
            store.min_record_bytes = MIN_COMPRESS_BYTES if options.codec != "none" else NO_RECORDS
            # One GPU budget: the stager gives the references what its plans leave (budget.reference_room).
            store.device_budget_bytes = 0
            stager.references = store
    backend = Backend(stager=stager, encoder=encoder, storage=storage, snapshot_mode=options.snapshot,
                      delta=encoder.delta)  # fmt: skip
    stager.on_mode = backend.set_snapshot_mode  # decided per save, from the memory measured then
    log.info(
        "asyncckpt: GPU path on %s (%s): nvCOMP %s, KvikIO %s, %s I/O with %d threads, codec=%s, snapshot=%s",
        device,
        _device_name(device),
        nv.__version__,
        kv.__version__,
        storage.io_mode,
        storage.threads,
        options.codec,
        options.snapshot,
    )
    return backend


def _device_name(device: object) -> str:
    import torch

    return str(torch.cuda.get_device_name(device))  # type: ignore[arg-type]
