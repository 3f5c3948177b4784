"""nvCOMP codecs on the GPU: every codec round-trips real training tensors (multi-chunk, tails,
every dtype class), the standard formats decode on the CPU, ``auto`` keeps the smallest
candidate and remembers it, and the device checksum equals the host definition."""

from __future__ import annotations

import zlib

import pytest
import torch
from gpu_env import Trainer, requires_gpu

from asyncckpt._codecs import get_decoder
from asyncckpt._gpu.checksum import crc32_device
from asyncckpt._gpu.decoders import NvcompDecoder
from asyncckpt._gpu.pipeline import GpuEncoder
from asyncckpt._gpu.specs import ALGORITHMS, CodecSpec, auto_candidates

pytestmark = requires_gpu


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    """Real training tensors of several dtypes, one over several 64 KiB chunks with a ragged tail."""
    trainer = Trainer(width=128, layers=2, autocast=True)
    for _ in range(30):
        trainer.step()
    trainer.backward()
    params = list(trainer.model.parameters())
    moments = trainer.optimizer.state[params[1]]
    big = torch.cat([p.detach().reshape(-1) for p in params])[: (3 << 16) + 1234]
    return {
        "fp32_weights": big,
        "fp32_exp_avg_sq": moments["exp_avg_sq"].reshape(-1),
        "fp32_grad_autocast": torch.cat([p.grad.reshape(-1) for p in params]),
        "bf16_weights": big.to(torch.bfloat16),
        "fp16_weights": big.to(torch.float16),
        "int64_tokens": trainer.batches.data[:50_000].to(trainer.device),
        "uint8_random": torch.randint(0, 256, (70_001,), dtype=torch.uint8, device=trainer.device),
        "bool_mask": (big > 0),
        "fp64": big.double(),
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("codec", sorted(ALGORITHMS))
def test_every_codec_round_trips_every_dtype_on_the_gpu(codec: str, tensors: dict[str, torch.Tensor]) -> None:
    encoder = GpuEncoder(codec, torch.device("cuda", torch.cuda.current_device()), chunk_bytes=1 << 16)
    try:
        for name, tensor in tensors.items():
            raw = _bytes(tensor)
            blob = encoder.encode(raw, tensor.dtype, name)
            assert blob.codec == codec and sum(r for _s, r in blob.chunks) == raw.numel(), name
            assert len(blob.chunks) == -(-raw.numel() // min(1 << 16, raw.numel())), name
            out = torch.empty_like(raw)
            NvcompDecoder(codec).decode(blob.data, blob.chunks, blob.params, out)
            assert torch.equal(out, raw), f"{codec} {name}"
            if codec in ("zstd", "lz4", "deflate"):  # standard formats: the CPU decoders read them
                host = torch.empty(raw.numel(), dtype=torch.uint8)
                get_decoder(codec, name).decode(blob.data.cpu(), blob.chunks, blob.params, host)
                assert torch.equal(host, raw.cpu()), f"{codec} {name} on the CPU"
    finally:
        encoder.close()


def test_tensor_wide_planes_round_trip_and_beat_per_chunk_planes_on_autocast_grads(
    tensors: dict[str, torch.Tensor],
) -> None:
    from asyncckpt._gpu.decoders import DecodeItem, decode_many

    encoder = GpuEncoder("auto", torch.device("cuda", torch.cuda.current_device()), chunk_bytes=1 << 16)
    try:
        for name, tensor in tensors.items():
            if not tensor.dtype.is_floating_point:
                continue
            raw = _bytes(tensor)
            sizes = {}
            for span in ("chunk", "tensor"):
                spec = CodecSpec("ans", "|u1", tensor.element_size(), span)
                encoder.chooser.chose(name, tensor.dtype, spec)  # force the spec for this key
                blob = encoder.encode(raw, tensor.dtype, name)
                assert blob.params == spec.params(), name
                out = torch.empty_like(raw)
                decode_many(spec, [DecodeItem(blob.data, blob.chunks, out, name)])
                assert torch.equal(out, raw), f"{name} {span}"
                sizes[span] = blob.stored_bytes
            if name == "fp32_grad_autocast":  # a plane of near-constant bytes gets its own ANS table
                assert sizes["tensor"] < sizes["chunk"], sizes
    finally:
        encoder.close()


def test_auto_keeps_the_smallest_candidate_and_remembers_it(tensors: dict[str, torch.Tensor]) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    auto, ans, bitcomp = GpuEncoder("auto", device), GpuEncoder("ans", device), GpuEncoder("bitcomp", device)
    try:
        for name, tensor in tensors.items():
            raw = _bytes(tensor)
            chosen = auto.encode(raw, tensor.dtype, name)
            assert chosen.stored_bytes <= ans.encode(raw, tensor.dtype, name).stored_bytes, name
            assert chosen.stored_bytes <= bitcomp.encode(raw, tensor.dtype, name).stored_bytes, name
            remembered = auto.chooser.remembered()
            if len(auto_candidates(tensor.dtype)) > 1:
                assert remembered[name] in auto_candidates(tensor.dtype)
                assert auto.chooser.specs_for(name, tensor.dtype) == (remembered[name],)  # no probe next time
            out = torch.empty_like(raw)
            NvcompDecoder(chosen.codec).decode(chosen.data, chosen.chunks, chosen.params, out)
            assert torch.equal(out, raw), name
        # FP32 gradients made under BF16 autocast have near-constant low bytes: whole-word ANS loses.
        assert auto.chooser.remembered()["fp32_grad_autocast"] != CodecSpec("ans", "<f4")
    finally:
        auto.close()
        ans.close()
        bitcomp.close()


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 4096, (1 << 20) + 3, (1 << 27) + 5])  # the last: many blocks
@pytest.mark.parametrize("offset", [0, 3, 8])
def test_device_checksum_equals_zlib_crc32(size: int, offset: int) -> None:
    gen = torch.Generator().manual_seed(size)
    host = torch.randint(0, 256, (size + offset,), dtype=torch.uint8, generator=gen)
    assert crc32_device(host.cuda()[offset:]) == f"{zlib.crc32(host[offset:].numpy().data):08x}"
