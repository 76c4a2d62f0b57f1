"""Putting a writable layer back into a container whose image mounts some of
its directories read-only (a volume, the NVIDIA runtime's driver and toolkit
mounts): the layer's entry for such a directory must not fail the restore.
Seen on the H100: `could not put opt of the checkpoint's writable layer back
into the container: Read-only file system`, and every GPU pod started fresh."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from services.containers import rootfs
from services.containers.confined import Root

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")


def layer(path: Path) -> None:
    with tarfile.open(path, "w") as tar:
        d = tarfile.TarInfo("opt")
        d.type, d.mode, d.uid, d.gid = tarfile.DIRTYPE, 0o755, 1234, 1234
        tar.addfile(d)
        f = tarfile.TarInfo("data/state.txt")
        data = b"written by the workload\n"
        f.size, f.mode = len(data), 0o644
        dd = tarfile.TarInfo("data")
        dd.type, dd.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(dd)
        tar.addfile(f, io.BytesIO(data))


def test_a_directory_mounted_read_only_in_the_new_container_is_left_as_mounted(
        tmp_path: Path) -> None:
    root, shared = tmp_path / "root", tmp_path / "shared"
    (root / "opt").mkdir(parents=True)
    shared.mkdir()
    (shared / "lib.so").write_text("toolkit")
    subprocess.run(["mount", "--bind", str(shared), str(root / "opt")], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(root / "opt")], check=True)
        layer(tmp_path / "rootfs.tar")
        r = Root(os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), "a test root")
        with r, tarfile.open(tmp_path / "rootfs.tar", "r|") as tar:
            for m in tar:
                rootfs._apply_member(r, tar, m)
        assert (root / "data" / "state.txt").read_text() == "written by the workload\n"
        assert (root / "opt" / "lib.so").read_text() == "toolkit"  # the mount, untouched
        assert (root / "opt").stat().st_uid == 0
    finally:
        subprocess.run(["umount", str(root / "opt")], check=False)
