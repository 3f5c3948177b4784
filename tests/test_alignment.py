"""The alignment arithmetic every layout uses (data files, arenas, packed groups, pinned blocks)."""

from __future__ import annotations

from asyncckpt._alignment import align_up, aligned_offsets


def test_align_up_is_the_next_multiple() -> None:
    for alignment in (1, 2, 16, 64, 512, 4096):
        for n in range(0, 3 * alignment + 2):
            up = align_up(n, alignment)
            assert up % alignment == 0 and n <= up < n + alignment, (n, alignment)


def test_aligned_offsets_pack_without_overlap() -> None:
    sizes = [0, 1, 63, 64, 65, 0, 1000, 7]
    offsets, total = aligned_offsets(sizes, 64)
    assert offsets[0] == 0 and all(o % 64 == 0 for o in offsets)
    ends = [o + s for o, s in zip(offsets, sizes, strict=True)]
    assert all(end <= following for end, following in zip(ends, offsets[1:], strict=False))
    assert total == align_up(ends[-1], 64) and aligned_offsets([], 64) == ([], 0)
