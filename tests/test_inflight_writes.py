"""The in-flight queue both GPU writers bound their queued buffers with, on real threads and files."""

from __future__ import annotations

import errno
import functools
import os
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from asyncckpt._storage import InflightWrites
from asyncckpt._storage.posix import create_for_writing, pwrite_fully


def test_add_waits_for_the_oldest_writes_beyond_the_bound_and_keeps_the_newest_running(tmp_path: Path) -> None:
    fd = create_for_writing(tmp_path / "data.bin")
    release = [threading.Event() for _ in range(4)]
    waited: list[int] = []

    def write(k: int) -> None:
        release[k].wait(10)
        pwrite_fully(fd, bytes([k]) * 100, k * 100)

    with ThreadPoolExecutor(4) as pool:
        writes = InflightWrites(limit_bytes=250)
        futures = [pool.submit(write, k) for k in range(4)]

        def waiter(k: int) -> object:
            waited.append(k)
            return futures[k].result()

        for k in range(2):
            writes.add(functools.partial(waiter, k), 100)
        assert waited == []  # 200 bytes queued: under the bound, nothing waited for
        for r in release:
            r.set()
        writes.add(functools.partial(waiter, 2), 100)  # 300 > 250: the oldest is waited for, down to 200
        assert waited == [0]
        writes.add(functools.partial(waiter, 3), 300)  # 500: 1 and 2 are waited for; the newest stays queued alone
        assert waited == [0, 1, 2]
        writes.wait_all()
        assert waited == [0, 1, 2, 3]
    os.close(fd)
    assert (tmp_path / "data.bin").read_bytes() == b"".join(bytes([k]) * 100 for k in range(4))


def test_a_failed_write_is_raised_by_the_wait_that_reaches_it_and_discard_forgets_the_rest(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "read-only.bin", os.O_RDONLY | os.O_CREAT, 0o600)  # every pwrite fails: EBADF
    with ThreadPoolExecutor(1) as pool:
        writes = InflightWrites(limit_bytes=1 << 20)
        writes.add(pool.submit(pwrite_fully, fd, b"x" * 10, 0).result, 10)
        writes.add(pool.submit(pwrite_fully, fd, b"y" * 10, 10).result, 10)
        with pytest.raises(OSError) as caught:
            writes.wait_all()
        assert caught.value.errno == errno.EBADF
        assert len(writes.discard()) == 1 and writes.discard() == []
    os.close(fd)


def test_a_failure_stays_raised_so_a_file_with_a_hole_is_never_synced_as_whole(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "read-only.bin", os.O_RDONLY | os.O_CREAT, 0o600)  # every pwrite fails: EBADF
    with ThreadPoolExecutor(1) as pool:
        writes = InflightWrites(limit_bytes=1 << 20)
        writes.add(pool.submit(pwrite_fully, fd, b"x" * 10, 0).result, 10)
        with pytest.raises(OSError) as first:
            writes.wait_all()
        depth = len(traceback.extract_tb(first.value.__traceback__))
        # A caller that caught the error and went on: every later call raises the same failure.
        for call in (writes.raise_if_failed, writes.wait_all, lambda: writes.add(lambda: None, 10)):
            with pytest.raises(OSError) as again:
                call()
            assert again.value is first.value
            assert len(traceback.extract_tb(again.value.__traceback__)) <= depth + 2  # not one frame more per raise
        assert writes.discard() == []  # the refused add queued nothing
    os.close(fd)
