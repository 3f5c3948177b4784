"""The ``mix64`` checksum computed on the GPU (see :mod:`asyncckpt.checksum` for the definition).

Same value as :func:`asyncckpt.checksum.mix64_host`, bit for bit: one pass of the
``mix64_words`` kernel (:mod:`asyncckpt.gpu.kernels`) sums the finalised words, the size is
XORed in on the host.

Streams: the kernel runs on a private per-device stream, so a checksum never queues behind
the training kernels on the default stream; the caller must pass a buffer whose contents are
already complete (its producing stream synchronized, as the pipeline does before it checksums).
The calling thread blocks until the value is on the host.

On a GPU with no memory left (the kernel needs one small result block, and a misaligned buffer a
copy), the checksum is computed on the host from a device-to-host copy instead: slower, never a
failed save.
"""

from __future__ import annotations

import threading

import torch

from ..checksum import mix64_host
from .kernels import mix64_sum

_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()


def _stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _streams:
            _streams[index] = torch.cuda.Stream(device=index)
        return _streams[index]


def mix64_device(buf: torch.Tensor) -> str:
    """The mix64 checksum of a 1-D uint8 CUDA tensor, as 16 hex digits.

    Blocks the calling thread until the value is known; see the module docstring for streams.
    """
    if buf.device.type != "cuda" or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(
            f"mix64_device takes a 1-D uint8 CUDA tensor, got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
        )
    size = buf.numel()
    if size == 0:
        return f"{0:016x}"
    stream = _stream(buf.device)
    try:
        if buf.data_ptr() % 8:  # the kernel reads whole words: copy the (rare) misaligned buffer
            with torch.cuda.stream(stream):
                buf = buf.clone()
        value = mix64_sum(buf, stream)
    except torch.OutOfMemoryError:
        return mix64_host(buf.cpu().numpy())
    return f"{value ^ size:016x}"
