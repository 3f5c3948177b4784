"""nvCOMP's C API (asyncckpt._gpu.native) against its Python API: the same bytes for every chunk, a
round trip through the Python decoder, and an encode that never waits for other streams' work."""

from __future__ import annotations

import pytest
import torch
from gpu_env import Trainer, requires_gpu

from asyncckpt._gpu import batch, native
from asyncckpt._gpu.specs import CodecSpec

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


def _decode(spec: CodecSpec, chunks: list[bytes], sizes: list[int], stream: torch.cuda.Stream) -> torch.Tensor:
    """Decode with nvCOMP's Python API (what a restore uses); chunks start 16-byte aligned, as a restore puts them."""
    starts = [sum(-(-len(c) // 16) * 16 for c in chunks[:i]) for i in range(len(chunks))]
    packed = torch.zeros(starts[-1] + len(chunks[-1]), dtype=torch.uint8)
    for start, chunk in zip(starts, chunks, strict=True):
        packed[start : start + len(chunk)] = torch.frombuffer(bytearray(chunk), dtype=torch.uint8)
    packed = packed.cuda()
    decoded = torch.empty(sum(sizes), dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(stream):
        out_offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        batch.decode(spec, batch.DeviceSpan(packed.data_ptr(), packed.numel()), starts, [len(c) for c in chunks],
                     batch.DeviceSpan(decoded.data_ptr(), decoded.numel()), out_offsets, sizes, stream)  # fmt: skip
    stream.synchronize()
    return decoded


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_c_api_chunks_decode_with_the_python_api(spec: CodecSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    assert native.available(spec), "nvCOMP 6 from the wheel should load through ctypes"
    data = _trained_bytes()
    stream = torch.cuda.Stream()
    c_chunks, sizes = _encode(spec, data, stream)
    with monkeypatch.context() as m:
        m.setattr(native, "available", lambda spec: False)  # the same call through nvCOMP's Python API
        py_chunks, _ = _encode(spec, data, stream)
    assert len(c_chunks) == len(py_chunks) == len(sizes)
    if spec.codec == "bitcomp":  # same options, same bytes
        assert c_chunks == py_chunks
    else:  # ANS: the Python API's defaults differ somewhere (its bytes differ); both are ANS streams
        ratio = sum(map(len, c_chunks)) / sum(map(len, py_chunks))
        assert 0.95 < ratio < 1.05, ratio
    if spec.data_type == "<f4":  # the data is FP32
        assert sum(map(len, c_chunks)) < data.numel()
    assert torch.equal(_decode(spec, c_chunks, sizes, stream), data)


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
