"""The GPU checks that need no GPU: room for a checkpoint before the job freezes."""

from __future__ import annotations

from pathlib import Path

import pytest

from smr import gpuinfo

GIB = 1 << 30
GPU = {"used_bytes": GIB}


def test_a_dump_into_a_tmpfs_needs_the_ram_twice(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    if not Path("/dev/shm").is_dir() or not gpuinfo.on_tmpfs(Path("/dev/shm")):
        pytest.skip("no /dev/shm tmpfs here")
    # Room for the driver's copy (1.1 GiB), not for the images in RAM as well.
    monkeypatch.setattr(gpuinfo, "_mem_available", lambda: int(1.5 * GIB))
    shm = Path("/dev/shm") / f"smr-test-{tmp_path.name}"
    try:
        with pytest.raises(gpuinfo.NoRoom) as e:
            gpuinfo.check_room_for_checkpoint(GPU, shm)
        assert "tmpfs" in e.value.message and "SMR_WORK_DIR" in (e.value.hint or "")
    finally:
        shm.rmdir()
    if gpuinfo.on_tmpfs(tmp_path):
        pytest.skip("the test's own directory is on a tmpfs too")
    gpuinfo.check_room_for_checkpoint(GPU, tmp_path / "work")  # a disk: RAM for the copy only


def test_on_tmpfs_follows_the_deepest_mount(tmp_path: Path) -> None:
    assert gpuinfo.on_tmpfs(Path("/proc")) is False
    if gpuinfo.on_tmpfs(Path("/dev/shm")):
        assert gpuinfo.on_tmpfs(Path("/dev/shm/not/yet/made")) is True
