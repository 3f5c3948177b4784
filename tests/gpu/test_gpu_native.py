"""nvCOMP's C API (asyncckpt.gpu.native) against its Python API: the same bytes for every chunk, a
round trip through the Python decoder, and an encode that never waits for other streams' work."""

from __future__ import annotations

import pytest
import torch
from gpu_env import Trainer, requires_gpu

from asyncckpt.gpu import batch, native
from asyncckpt.gpu.specs import CodecSpec

pytestmark = requires_gpu

CHUNK = 64 << 10
SPECS = [
    CodecSpec("ans", "<f4"),
    CodecSpec("ans", "<f2"),
    CodecSpec("ans", "|u1"),
    CodecSpec("bitcomp", "<f4"),
    CodecSpec("bitcomp", "<f2"),
    CodecSpec("bitcomp", "<i8"),
    CodecSpec("bitcomp", "|u1"),
]


def _trained_bytes() -> torch.Tensor:
    """Real training state (weights and Adam moments) as bytes on the GPU, not a multiple of the chunk size."""
    trainer = Trainer(width=128, layers=2)
    for _ in range(5):
        trainer.step()
    tensors = [p.detach().reshape(-1) for p in trainer.model.parameters()]
    tensors += [s["exp_avg_sq"].reshape(-1) for s in trainer.optimizer.state.values()]
    data = torch.cat(tensors).view(torch.uint8)
    return data[: (data.numel() - 4088) // 8 * 8].clone()  # whole 8-byte words, a short last chunk


def _encode(spec: CodecSpec, data: torch.Tensor, stream: torch.cuda.Stream) -> tuple[list[bytes], list[int]]:
    offsets = list(range(0, data.numel(), CHUNK))
    sizes = [min(CHUNK, data.numel() - o) for o in offsets]
    span = batch.DeviceSpan(data.data_ptr(), data.numel(), batch.typestr_for(spec))
    pending = batch.encode(spec, span, offsets, sizes, stream, CHUNK, [data])
    stored = pending.sizes()
    out = pending.out.cpu().numpy()
    chunks = [out[o : o + n].tobytes() for o, n in zip(pending.out_offsets, stored, strict=True)]
    return chunks, sizes


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_c_api_chunks_equal_the_python_api_and_decode(spec: CodecSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    assert native.available(spec), "nvCOMP 6 from the wheel should load through ctypes"
    data = _trained_bytes()
    stream = torch.cuda.Stream()
    c_chunks, sizes = _encode(spec, data, stream)
    with monkeypatch.context() as m:
        m.setattr(native, "available", lambda spec: False)  # the same call through nvCOMP's Python API
        py_chunks, _ = _encode(spec, data, stream)
    assert len(c_chunks) == len(py_chunks) == len(sizes)
    assert c_chunks == py_chunks
    assert sum(map(len, c_chunks)) < data.numel()  # real state compresses

    packed = torch.frombuffer(bytearray(b"".join(c_chunks)), dtype=torch.uint8).to("cuda")
    src_offsets, position = [], 0
    for chunk in c_chunks:
        src_offsets.append(position)
        position += len(chunk)
    decoded = torch.empty_like(data)
    with torch.cuda.stream(stream):
        batch.decode(spec, batch.DeviceSpan(packed.data_ptr(), packed.numel()), src_offsets,
                     [len(c) for c in c_chunks], batch.DeviceSpan(decoded.data_ptr(), decoded.numel()),
                     list(range(0, data.numel(), CHUNK)), sizes, stream)  # fmt: skip
    stream.synchronize()
    assert torch.equal(decoded, data)


def test_an_encode_does_not_wait_for_work_on_other_streams() -> None:
    spec = CodecSpec("ans", "<f4")
    data = _trained_bytes()
    stream, training = torch.cuda.Stream(), torch.cuda.Stream()
    _encode(spec, data, stream)  # warm: library loaded, bounds cached
    with torch.cuda.stream(training):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time on the "training" stream
        busy = torch.cuda.Event()
        busy.record()
    offsets = list(range(0, data.numel(), CHUNK))
    sizes = [min(CHUNK, data.numel() - o) for o in offsets]
    pending = batch.encode(spec, batch.DeviceSpan(data.data_ptr(), data.numel(), "<f4"), offsets, sizes, stream,
                           CHUNK, [data])  # fmt: skip
    stored = pending.sizes()  # waits for the encode, which must not have waited for the sleep
    assert not busy.query(), "the encode waited for another stream's work"
    assert len(stored) == len(sizes)
    busy.synchronize()
