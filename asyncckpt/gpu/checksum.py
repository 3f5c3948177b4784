"""The ``mix64`` checksum computed on the GPU (see :mod:`asyncckpt.checksum` for the definition).

Same value as :func:`asyncckpt.checksum.mix64_host`, bit for bit. The uint64 arithmetic of
the definition runs in int64 tensors: multiplication, addition and XOR give the same low 64
bits for signed and unsigned operands, and the logical right shifts are arithmetic shifts
masked to the bits a logical shift keeps.

Streams: every kernel runs on a private per-device stream, so a checksum never queues behind
the training kernels on the default stream; the caller must pass a buffer whose contents are
already complete (its producing stream synchronized, as the pipeline does before it checksums).
The calling thread blocks until the value is on the host.
"""

from __future__ import annotations

import threading

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_MASK30 = (1 << 34) - 1  # keeps the 34 bits a logical ">> 30" leaves
_MASK27 = (1 << 37) - 1
_MASK31 = (1 << 33) - 1
_BLOCK_WORDS = 1 << 25
"""Words per pass (256 MiB of input): bounds the int64 temporaries to 512 MiB."""

_streams: dict[int, torch.cuda.Stream] = {}
_lock = threading.Lock()


def _stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        if index not in _streams:
            _streams[index] = torch.cuda.Stream(device=index)
        return _streams[index]


def _mix_words(words: torch.Tensor, first_position: int) -> torch.Tensor:
    """Sum (mod 2**64, as int64) of the finalised words; ``words`` is a 1-D int64 tensor."""
    x = torch.arange(first_position, first_position + words.numel(), dtype=torch.int64, device=words.device)
    x.mul_(_GOLDEN).bitwise_xor_(words)
    x.bitwise_xor_(x.bitwise_right_shift(30).bitwise_and_(_MASK30))
    x.mul_(_M1)
    x.bitwise_xor_(x.bitwise_right_shift(27).bitwise_and_(_MASK27))
    x.mul_(_M2)
    x.bitwise_xor_(x.bitwise_right_shift(31).bitwise_and_(_MASK31))
    return x.sum(dtype=torch.int64)


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
    with torch.cuda.stream(stream):
        whole = size // 8
        total = torch.zeros((), dtype=torch.int64, device=buf.device)
        # A view as int64 needs an 8-byte aligned start; copy the (rare) misaligned buffer.
        body = buf[: whole * 8] if buf.data_ptr() % 8 == 0 else buf[: whole * 8].clone()
        words = body.view(torch.int64) if whole else body.new_empty(0).view(torch.int64)
        for start in range(0, whole, _BLOCK_WORDS):
            total += _mix_words(words[start : start + _BLOCK_WORDS], start)
        if size % 8:
            tail = torch.zeros(8, dtype=torch.uint8, device=buf.device)
            tail[: size % 8] = buf[whole * 8 :]
            total += _mix_words(tail.view(torch.int64), whole)
        value = int(total.item())  # synchronizes this private stream only
    return f"{(value & 0xFFFFFFFFFFFFFFFF) ^ size:016x}"
