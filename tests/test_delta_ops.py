"""delta_ops: decode(encode(x, r), r) == x bit for bit, for both ops and every storable dtype (NaN payloads too)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_states import DTYPES

from asyncckpt._delta_ops import DELTA_OPS, decode_delta, element_width, encode_delta


def _raw(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@given(dtype=st.sampled_from(DTYPES), op=st.sampled_from(DELTA_OPS), count=st.integers(0, 64), data=st.data())
def test_every_op_inverts_exactly_for_every_dtype(dtype: torch.dtype, op: str, count: int, data: st.DataObject) -> None:
    size = count * dtype.itemsize
    new = _raw(data.draw(st.binary(min_size=size, max_size=size)))
    ref = _raw(data.draw(st.binary(min_size=size, max_size=size)))
    before = new.clone()
    stored = encode_delta(new, ref, op, dtype)
    assert torch.equal(new, before), "encode_delta must not modify its input"
    assert stored.dtype == torch.uint8 and stored.numel() == size
    assert bytes(decode_delta(stored.clone(), ref, op, dtype).numpy()) == bytes(before.numpy())


@pytest.mark.parametrize("op", DELTA_OPS)
def test_nan_payloads_and_signed_zeros_survive(op: str) -> None:
    bits = torch.tensor([0x7FF8000000000001, -0x0008000000000001, 0x7FF0000000000001, -(1 << 63), 0, 1],
                        dtype=torch.int64)  # fmt: skip
    new, ref = bits.view(torch.uint8), bits.flip(0).view(torch.uint8).clone()
    back = decode_delta(encode_delta(new, ref, op, torch.float64), ref, op, torch.float64)
    assert torch.equal(back.view(torch.int64), bits)


def test_sub_makes_small_drift_small_numbers() -> None:
    ref = torch.randn(1000)
    new = torch.nextafter(ref, torch.full_like(ref, float("inf")))  # one ulp up or down per element
    stored = encode_delta(new.view(torch.uint8), ref.view(torch.uint8), "sub", torch.float32).view(torch.int32)
    assert int(stored.max()) <= 2  # zigzag of +-1
    unchanged = encode_delta(ref.view(torch.uint8), ref.view(torch.uint8).clone(), "xor", torch.float32)
    assert not unchanged.any()


def test_complex_and_one_byte_widths() -> None:
    assert element_width(torch.complex64) == 4 and element_width(torch.complex128) == 8
    assert element_width(torch.bool) == 1 and element_width(torch.float8_e4m3fn) == 1


def test_unaligned_views_and_size_mismatches() -> None:
    buf = torch.arange(17, dtype=torch.uint8)
    new, ref = buf[1:], torch.zeros(16, dtype=torch.uint8)  # offset 1: not aligned for 4-byte lanes
    stored = encode_delta(new, ref, "sub", torch.int32)
    assert torch.equal(decode_delta(stored, ref, "sub", torch.int32), new)
    with pytest.raises(ValueError, match="reference"):
        encode_delta(new, torch.zeros(8, dtype=torch.uint8), "xor", torch.int32)
    with pytest.raises(ValueError, match="unknown delta op"):
        encode_delta(new, ref, "add", torch.int32)
