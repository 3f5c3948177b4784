"""Rounding sizes up to an alignment, and packing byte ranges at aligned offsets.

One place for the arithmetic that the data files (4 KiB for O_DIRECT/GDS), the staging arenas
(64 B on the host, 512 B on the GPU), packed compressed groups (16 B) and pinned blocks (2 MiB)
each need. Imports nothing; any thread.
"""

from __future__ import annotations

from collections.abc import Iterable


def align_up(nbytes: int, alignment: int) -> int:
    """The smallest multiple of ``alignment`` that is at least ``nbytes`` (both >= 0; alignment > 0)."""
    return (nbytes + alignment - 1) // alignment * alignment


def aligned_offsets(sizes: Iterable[int], alignment: int) -> tuple[list[int], int]:
    """Offsets of consecutive ranges of ``sizes`` bytes, each starting at a multiple of
    ``alignment``; and the total size of the buffer that holds them."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += align_up(size, alignment)
    return offsets, end
