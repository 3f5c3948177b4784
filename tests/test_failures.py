"""Background failures (disk full, permission denied) are raised, never swallowed; the last good checkpoint stays."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import REFUSED_WRITES_PRELUDE, run_python

import asyncckpt


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs, so writes fail with ENOSPC like a full disk."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_disk_full_is_raised_everywhere_and_latest_stays(small_filesystem: Path) -> None:
    run = small_filesystem / "run"
    small = {"w": torch.arange(1000, dtype=torch.float32)}
    # Random bytes don't compress: 8 MiB cannot fit on a 4 MiB file system.
    big = {"w": torch.randint(0, 2**31 - 1, (2 << 20,), dtype=torch.int32)}
    ckpt = asyncckpt.AsyncCheckpointer(run, codec="none")
    ckpt.save(1, small).result()
    failed = ckpt.save(2, big)
    with pytest.raises(asyncckpt.SaveFailedError, match="saving step 2 .* failed: OSError: .*No space left") as info:
        failed.result()
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(asyncckpt.SaveFailedError, match="step 2"):
        ckpt.save(3, small)  # the next save() raises it once ...
    ckpt.save(4, small).result()  # ... and then the checkpointer works again
    ckpt.close()
    assert asyncckpt.latest_step(run) == 4
    assert [c.step for c in asyncckpt.list_checkpoints(run)] == [1, 4]
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp-")], "the failed save left no temporary dir"


def test_close_raises_an_unreported_failure(small_filesystem: Path) -> None:
    run = small_filesystem / "run"
    ckpt = asyncckpt.AsyncCheckpointer(run, codec="none")
    ckpt.save(1, {"w": torch.ones(10)}).result()
    ckpt.save(2, {"w": torch.randint(0, 2**31 - 1, (2 << 20,), dtype=torch.int32)})
    with pytest.raises(asyncckpt.SaveFailedError, match="No space left"):
        ckpt.close()
    assert asyncckpt.latest_step(run) == 1
    assert torch.equal(asyncckpt.load(run)["w"], torch.ones(10))


def test_permission_denied(run_dir: Path) -> None:
    if shutil.which("chattr") is None:
        pytest.skip("chattr not installed")
    ckpt = asyncckpt.AsyncCheckpointer(run_dir)
    ckpt.save(1, {"w": torch.ones(3)}).result()
    # An immutable directory refuses new entries even to root (the tests run as root in CI).
    subprocess.run(["chattr", "+i", str(run_dir)], check=True)
    try:
        with pytest.raises(asyncckpt.SaveFailedError, match="PermissionError|Operation not permitted"):
            ckpt.save(2, {"w": torch.zeros(3)}).result()
        with pytest.raises(asyncckpt.SaveFailedError):
            ckpt.wait()  # wait() reports it once too
        ckpt.wait()
    finally:
        subprocess.run(["chattr", "-i", str(run_dir)], check=True)
        ckpt.close()
    assert asyncckpt.latest_step(run_dir) == 1


_FILE_SIZE_LIMIT = (
    REFUSED_WRITES_PRELUDE
    + """
import json, sys, torch
ckpt = asyncckpt.AsyncCheckpointer(sys.argv[1], codec="none")
ckpt.save(1, {"w": torch.ones(100)}).result()
handle = ckpt.save(2, {"w": torch.ones(1 << 20)})   # 4 MiB > the 1 MiB file size limit
print(json.dumps(failures(handle, ckpt)))
"""
)


def test_file_size_limit_in_a_subprocess(run_dir: Path) -> None:
    proc = run_python(_FILE_SIZE_LIMIT, str(run_dir))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "File too large" in out["result"]
    assert "File too large" in out["close"]  # never reported by save(), so close() raises it
    assert asyncckpt.latest_step(run_dir) == 1


_WRITER_AFTER_A_FAILURE = (
    REFUSED_WRITES_PRELUDE
    + """
import json, pathlib, sys, torch
from asyncckpt._storage.posix import PosixBlobWriter
writer = PosixBlobWriter(pathlib.Path(sys.argv[1]))
out = {}
for name, call in (("big", lambda: writer.append(torch.ones(1 << 19))),  # 2 MiB > the 1 MiB limit
                   ("small", lambda: writer.append(torch.ones(4))), ("sync", writer.sync)):
    try:
        call()
        out[name] = None
    except OSError as exc:
        out[name] = exc.strerror
writer.close()
print(json.dumps(out))
"""
)


def test_a_posix_writer_that_failed_refuses_every_later_append_and_sync(tmp_path: Path) -> None:
    # Without the refusal, the small append would land at offset 0 and sync would call the file whole.
    proc = run_python(_WRITER_AFTER_A_FAILURE, str(tmp_path / "data.bin"))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"big": "File too large", "small": "File too large", "sync": "File too large"}


def test_a_replacing_publish_that_fails_to_rename_puts_the_old_checkpoint_back(
    tmp_path: Path, small_filesystem: Path
) -> None:
    """publish(replace=True) moves the old checkpoint aside first; when the rename of the new one then
    fails (here for real: EXDEV, the new one sits on another file system), the old one comes back."""
    from asyncckpt._commit import publish

    run = tmp_path / "run"
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with asyncckpt.AsyncCheckpointer(run) as ckpt:
        final = ckpt.save(1, state).result().path
    before = sorted(p.name for p in run.iterdir())
    replacement = small_filesystem / "replacement"
    shutil.copytree(final, replacement)
    with pytest.raises(OSError) as raised:
        publish(replacement, final, replace=True)
    assert raised.value.errno == 18  # EXDEV: the failure this test is about, not an earlier one
    assert sorted(p.name for p in run.iterdir()) == before  # nothing left aside, nothing new
    assert torch.equal(asyncckpt.load(run, step=1)["w"], state["w"])
    assert asyncckpt.verify(run, step=1).tensors == 1  # raises on anything corrupt
    assert replacement.is_dir()  # the caller still holds its temporary directory to clean up
