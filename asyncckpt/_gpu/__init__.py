"""The GPU data path: staging on the device, nvCOMP compression, KvikIO I/O, GPU restore.

Map (the data path, in order):

* :mod:`.staging` — ``device`` arena copies, ``fence`` events, ``host`` pinned copies (training thread);
* :mod:`.fence` — the optimizer step pre-hook that holds the next step on the GPU;
* :mod:`.pipeline` — the compressor thread: batched nvCOMP encodes on its own CUDA stream;
  :mod:`.batch` (one nvCOMP call over many chunks), :mod:`.planes`, :mod:`.specs`, :mod:`.auto`;
* :mod:`.storage` — KvikIO writes and reads (GPUDirect Storage or compat mode), the pinned
  sequential reader restores use in compat mode;
* :mod:`.restore` and :mod:`.decoders` — loading onto the GPU; :mod:`.checksum` — CRC-32 on the device (nvCOMP);
* :mod:`.kernels` — the CUDA kernels torch lacks (batched range copy, plane split
  and join), compiled with CuPy's NVRTC at first use;
* :mod:`.backend` — assembles the above for a checkpointer; :mod:`.deps` — the lazy imports.

Nothing here imports nvCOMP, KvikIO or CuPy at import time; :mod:`.deps` does on first use and
raises :class:`~asyncckpt.errors.MissingDependencyError` with the pip line when they are absent.
"""
