"""An operating-system error while loading is a CheckpointError naming the file and offset, never a bare OSError."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO

import asyncckpt
from asyncckpt._storage import PosixStorage


def test_a_failing_read_names_the_file_and_offset(tmp_path: Path) -> None:
    # pread on a directory descriptor fails in the kernel (EISDIR), as a failing disk fails with EIO.
    reader = PosixStorage().open_reader(tmp_path)
    try:
        with pytest.raises(
            asyncckpt.CorruptCheckpointError,
            match=rf"{re.escape(str(tmp_path))}: cannot read 64 bytes at offset 8192: ",
        ):
            reader.read(8192, 64)
    finally:
        reader.close()


def _write_only_sysfs_attribute() -> Path | None:
    """A sysfs file that is regular and 4096 bytes to lstat but that open() refuses, even to root."""
    for pattern in ("devices/pci*/*/rescan", "bus/pci/rescan", "class/zram-control/hot_remove"):
        for path in sorted(Path("/sys").glob(pattern)):
            try:
                path.open("rb").close()
            except PermissionError:
                return path
            except OSError:
                continue
    return None


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare(1) for a private mount namespace")
def test_a_data_file_the_os_refuses_to_open_is_a_checkpoint_error(run_dir: Path) -> None:
    refusing = _write_only_sysfs_attribute()
    if refusing is None:
        pytest.skip("no write-only sysfs attribute here")
    with asyncckpt.AsyncCheckpointer(run_dir, codec="none") as ckpt:
        path = ckpt.save(1, {"w": torch.ones(16)}).result().path
    assert path is not None
    data = path / "data-0.bin"
    code = (
        "import sys, asyncckpt\n"
        "try:\n    asyncckpt.load(sys.argv[1])\nexcept asyncckpt.CheckpointError as exc:\n    print('REFUSED', exc)\n"
    )
    # The bind mount lives only in the private namespace of this one subprocess.
    script = f'mount --bind "$1" "$2" && exec "{sys.executable}" -c "$3" "$4"'
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", str(refusing),
                           str(data), code, str(run_dir)], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})  # fmt: skip
    if proc.returncode and ("mount" in proc.stderr or "unshare" in proc.stderr):
        pytest.skip(f"cannot bind-mount here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert f"REFUSED {data}: cannot open the data file: [Errno 13] Permission denied" in proc.stdout
