"""After one failed save, the checkpointer keeps working: no leaked staging, no hang, honest outcomes."""

from __future__ import annotations

import logging
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch

import asyncckpt
from asyncckpt._codecs.deflate import DeflateDecoder
from asyncckpt._layout import LATEST_NAME


@pytest.mark.timeout(60)
def test_failure_before_the_data_file_releases_the_staging_slot(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir, max_inflight=1) as ckpt:
        ckpt.save(1, {"w": torch.ones(8)}).result()
        shutil.rmtree(run_dir)
        run_dir.write_bytes(b"")  # a file where the run directory was: the save fails before any write
        with pytest.raises(asyncckpt.SaveFailedError, match="FileExistsError"):
            ckpt.save(2, {"w": torch.ones(8)}).result()
        run_dir.unlink()
        with pytest.raises(asyncckpt.SaveFailedError):
            ckpt.save(3, {"w": torch.ones(8)})  # reports step 2's failure once
        ckpt.save(4, {"w": torch.full((8,), 4.0)}).result()  # would block forever on a leaked slot
    assert asyncckpt.latest_step(run_dir) == 4


def test_a_run_directory_deleted_mid_run_is_recreated(run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="asyncckpt"), asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        ckpt.save(1, {"w": torch.ones(8)}).result()
        shutil.rmtree(run_dir)
        ckpt.save(2, {"w": torch.full((8,), 2.0)}).result()
        ckpt.save(3, {"w": torch.full((8,), 3.0)}).result()
    assert "is gone; recreating it" in caplog.text
    assert [c.step for c in asyncckpt.list_checkpoints(run_dir)] == [2, 3]
    assert asyncckpt.latest_step(run_dir) == 3 and float(asyncckpt.load(run_dir)["w"][0]) == 3.0


@pytest.mark.timeout(60)
def test_out_of_memory_while_staging_keeps_the_slot(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncckpt._snapshot.host as host

    real_empty = torch.empty

    def empty_failing_for_the_arena(*args: object, **kwargs: object) -> torch.Tensor:
        if args and args[0] == 8192 and kwargs.get("dtype") is torch.uint8:
            raise RuntimeError("out of memory (pinned host allocation)")
        return real_empty(*args, **kwargs)  # type: ignore[call-overload,no-any-return]

    with asyncckpt.AsyncCheckpointer(run_dir, max_inflight=1) as ckpt:
        monkeypatch.setattr(host.torch, "empty", empty_failing_for_the_arena)
        with pytest.raises(RuntimeError, match="out of memory"):
            ckpt.save(1, {"w": torch.ones(2048)})  # 8192 bytes of staging (over CLONE_BYTES: the arena)
        monkeypatch.undo()
        ckpt.save(2, {"w": torch.ones(2048)}).result()
    assert asyncckpt.latest_step(run_dir) == 2


def test_a_pointer_that_cannot_be_written_does_not_fail_a_committed_save(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir.mkdir()
    (run_dir / LATEST_NAME).mkdir()  # rename(file, directory) fails: a real OS error after the commit
    with caplog.at_level(logging.WARNING, logger="asyncckpt"), asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        result = ckpt.save(7, {"w": torch.ones(3)}).result()
    assert result.path == run_dir / "step-0000000007"
    assert "the 'latest' pointer in" in caplog.text and "could not be set to step-0000000007" in caplog.text
    assert asyncckpt.latest_step(run_dir) == 7  # readers fall back to the highest committed step
    assert torch.equal(asyncckpt.load(run_dir)["w"], torch.ones(3))


@pytest.mark.timeout(30)
def test_a_fifo_as_latest_pointer_does_not_hang(run_dir: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        ckpt.save(1, {"w": torch.ones(1)})
        ckpt.save(2, {"w": torch.ones(1) * 2})
    (run_dir / LATEST_NAME).unlink()
    os.mkfifo(run_dir / LATEST_NAME)
    assert asyncckpt.latest_step(run_dir) == 2
    assert float(asyncckpt.load(run_dir)["w"]) == 2.0


def test_a_symlinked_manifest_is_refused(run_dir: Path, tmp_path: Path) -> None:
    with asyncckpt.AsyncCheckpointer(run_dir) as ckpt:
        path = ckpt.save(1, {"w": torch.ones(1)}).result().path
    assert path is not None
    outside = tmp_path / "elsewhere.json"
    (path / "manifest.json").rename(outside)
    (path / "manifest.json").symlink_to(outside)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="cannot read manifest"):
        asyncckpt.load(path)


def test_deflate_chunk_declared_empty_is_not_inflated_without_limit() -> None:
    stream = zlib.compressobj(wbits=-15)
    data = stream.compress(bytes(64 << 20)) + stream.flush()
    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    with pytest.raises(asyncckpt.CorruptCheckpointError, match="deflate"):
        DeflateDecoder().decode(blob, [(len(data), 0)], {"planes": 1}, torch.empty(0, dtype=torch.uint8))
