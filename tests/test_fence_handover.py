"""What a ``fence`` save hands the writer once a group's pack (and its copy to pinned memory) has run.

The fenced compressor queues each group's pack and CRC-32s on a stream of its own and only then
learns the checksums and, for a group copied to the host, where its blobs now live
(``_Packed.finished``, ``_Outgoing.group``). The CUDA events are stood in for here (this machine has
no GPU; the real streams run in tests/gpu/test_gpu_full.py); the bookkeeping is searched: every
packed blob must get its own checksum and its bytes at the same offset of the host copy, and the
group's raw blobs neither.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncckpt._codecs.base import EncodedBlob
from asyncckpt._gpu.native import Crc32Batch
from asyncckpt._gpu.pipeline import _Outgoing, _Packed

ALREADY_DONE: Any = SimpleNamespace(synchronize=lambda: None)
"""Stands in for a CUDA event that has passed."""


def packed_group(draw: Any) -> tuple[_Packed, list[bool], list[bytes]]:
    """A group of blobs in tensor order: some packed back to back (16-byte aligned) in one buffer,
    some raw (their own bytes, outside it); with or without nvCOMP's checksums."""
    kinds = draw(st.lists(st.booleans(), min_size=1, max_size=12))  # True: packed
    contents = [draw(st.binary(min_size=0 if not packed else 1, max_size=40)) for packed in kinds]
    buffer = torch.zeros(max(1, sum(-(-len(c) // 16) * 16 for c in contents)), dtype=torch.uint8)
    blobs, indices, position = [], [], 0
    first = draw(st.integers(0, 1000))
    for offset, (packed, content) in enumerate(zip(kinds, contents, strict=True)):
        index = first + offset
        data = torch.frombuffer(bytearray(content), dtype=torch.uint8) if content else torch.empty(0, dtype=torch.uint8)
        if packed:
            buffer[position : position + len(content)] = data
            blob = EncodedBlob(data=buffer[position : position + len(content)], codec="ans", chunks=[(len(content), 1)])
            indices.append(index)
            position += -(-len(content) // 16) * 16
        else:
            blob = EncodedBlob(data=data, codec="none", chunks=[(len(content), len(content))])
        blobs.append((index, blob))
    checksums = None
    if draw(st.booleans()):
        results = torch.tensor([1000 + i for i in range(len(indices))] + [0] * len(indices), dtype=torch.int64)
        checksums = Crc32Batch(count=len(indices), done=ALREADY_DONE, host_results=results)
    packed = _Packed(blobs, position, buffer, ALREADY_DONE, checksums, indices, [])
    return packed, kinds, contents


@settings(max_examples=300, deadline=None)
@given(st.data(), st.booleans())
def test_every_packed_blob_gets_its_own_checksum_and_its_host_bytes_and_raw_blobs_neither(
    data: st.DataObject, spilled: bool
) -> None:
    packed, kinds, contents = packed_group(data.draw)
    host = None
    if spilled:  # the host copy holds the buffer's bytes at the same offsets
        host = torch.full((packed.buffer.numel() + 64,), 0xEE, dtype=torch.uint8)
        host[: packed.buffer.numel()] = packed.buffer
        packed.buffer.fill_(0)  # the GPU buffer may be reused once the copy has landed
    outgoing = _Outgoing(packed.nbytes, ALREADY_DONE, packed, host=host, copying=spilled)
    group = outgoing.group()
    assert [index for index, _ in group] == [index for index, _ in packed.blobs]
    packed_seen = 0
    for (index, blob), is_packed, content in zip(group, kinds, contents, strict=True):
        assert bytes(blob.data.numpy()) == content, index
        if not is_packed:
            assert blob.crc32 is None and blob.codec == "none"
            continue
        expected = None if packed.checksums is None else f"{1000 + packed_seen:08x}"
        assert blob.crc32 == expected, (index, blob.crc32, expected)
        if host is not None:  # the same offset in the host copy as in the buffer
            in_buffer = dict(packed.blobs)[index].data.data_ptr() - packed.buffer.data_ptr()
            assert blob.data.data_ptr() - host.data_ptr() == in_buffer, index
        packed_seen += 1
