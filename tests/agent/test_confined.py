"""services/containers/confined: opening a tenant's files from a root held open,
with openat2 and with its fallback (each component O_NOFOLLOW), on a
directory laid out as a hostile container's would be."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.containers import confined
from services.containers.confined import Root, UnsafePath
from tests.agent.opens import Opens


@pytest.fixture(params=["openat2", "fallback"])
def root(request: pytest.FixtureRequest, tmp_path: Path,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Root, Path, Path]]:
    if request.param == "fallback":  # a kernel without openat2 (Linux < 5.6)
        monkeypatch.setattr(confined._libc, "syscall", _enosys)
    top = tmp_path / "container"
    (top / "smr/main").mkdir(parents=True)
    host = tmp_path / "host-file"
    host.write_text("host secret\n")
    r = Root(os.open(top, os.O_PATH | os.O_DIRECTORY), "the test container")
    yield r, top, host
    r.close()
    assert confined.has_openat2() is (request.param == "openat2"), "the other path ran"
    assert host.read_text() == "host secret\n", "a host file was changed"


def _enosys(*args: object) -> int:
    import ctypes

    ctypes.set_errno(errno.ENOSYS)
    return -1


def test_reads_and_writes_smrs_own_files(root: tuple[Root, Path, Path]) -> None:
    r, top, _ = root
    (top / "smr/main/status").write_text("running 7 fresh\n")
    assert r.read("/smr/main/status") == b"running 7 fresh\n"
    r.replace("/smr/main/decision", b"fresh\n")
    assert (top / "smr/main/decision").read_text() == "fresh\n"
    r.write_new("/smr/main/hold", b"")
    r.write_new("/smr/main/hold", b"")  # an earlier run's hold is replaced
    r.unlink("/smr/main/hold")
    assert not (top / "smr/main/hold").exists()


@pytest.mark.parametrize("name", ["status", "hold"])
def test_a_symlink_to_the_host_is_refused(root: tuple[Root, Path, Path], name: str) -> None:
    r, top, host = root
    (top / "smr/main" / name).symlink_to(host)
    with pytest.raises(UnsafePath, match="symlink"):
        if name == "status":
            r.read("/smr/main/status")
        else:
            r.write_new("/smr/main/hold", b"")


def test_a_planted_temporary_name_is_replaced_not_followed(
        root: tuple[Root, Path, Path]) -> None:
    r, top, host = root
    (top / "smr/main/.decision.smr-tmp").symlink_to(host)
    (top / "smr/main/decision").symlink_to(host)
    r.replace("/smr/main/decision", b"fresh\n")
    assert not (top / "smr/main/decision").is_symlink()
    assert (top / "smr/main/decision").read_text() == "fresh\n"


def test_a_symlinked_directory_on_the_way_is_refused(root: tuple[Root, Path, Path]) -> None:
    r, top, host = root
    (top / "smr/main").rmdir()
    (top / "smr/main").symlink_to(host.parent)
    with pytest.raises(UnsafePath):
        r.read("/smr/main/host-file")


def test_dotdot_stays_in_the_container(root: tuple[Root, Path, Path]) -> None:
    r, _, _ = root
    with pytest.raises((UnsafePath, FileNotFoundError)):
        r.read("/smr/../../host-file")


def test_fifos_devices_and_large_files_are_not_read(root: tuple[Root, Path, Path]) -> None:
    r, top, _ = root
    os.mkfifo(top / "smr/main/status")  # no writer: a blocking open would hang here
    with pytest.raises(UnsafePath, match="FIFO"):
        r.read("/smr/main/status")
    (top / "smr/main/big").write_bytes(b"x" * (confined.SMALL + 1))
    with pytest.raises(UnsafePath, match="more than"):
        r.read("/smr/main/big")
    os.mknod(top / "smr/main/zero", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero
    with pytest.raises(UnsafePath, match="not a regular file"):
        r.read("/smr/main/zero")


def test_touch_refreshes_a_file_in_place_and_never_a_link_or_fifo(
        root: tuple[Root, Path, Path]) -> None:
    """The hold's refresh (smr-init ignores a hold untouched for 60 s)."""
    r, top, host = root
    hold = top / "smr/main/hold"
    hold.write_text("")
    os.utime(hold, (1, 1))
    inode = hold.stat().st_ino
    r.touch("/smr/main/hold")
    assert hold.stat().st_ino == inode and hold.stat().st_mtime > 1
    hold.unlink()
    os.utime(host, (1, 1))
    hold.symlink_to(host)
    with pytest.raises(UnsafePath, match="symlink"):
        r.touch("/smr/main/hold")
    assert host.stat().st_mtime == 1, "the host file's times were changed"
    hold.unlink()
    os.mkfifo(hold)
    with pytest.raises(UnsafePath, match="FIFO"):
        r.touch("/smr/main/hold")


def test_a_device_or_fifo_where_a_file_is_read_locked_or_captured_is_never_opened(
        root: tuple[Root, Path, Path]) -> None:
    """Opening a device is not free of effects (a watchdog is armed by its
    open): a device node is fstat-checked through an O_PATH descriptor and
    refused, never opened, wherever the agent reads, locks or copies a file."""
    r, top, _ = root
    main = top / "smr/main"
    for name in ("status", "signal.lock", "layer-file"):
        os.mknod(main / name, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null
    opens = Opens()
    try:
        for name in ("status", "signal.lock", "layer-file"):
            opens.watch(str(main / name))
        with pytest.raises(UnsafePath, match="not a regular file"):
            r.read("/smr/main/status")
        with pytest.raises(UnsafePath, match="not a regular file"):
            r.file("/smr/main/signal.lock", os.O_RDONLY | os.O_NONBLOCK, create=0o644)
        d = os.open(main, os.O_PATH | os.O_DIRECTORY)
        try:
            with pytest.raises(OSError, match="not a regular file"):
                confined.open_regular_at(d, "layer-file", os.O_RDONLY | os.O_NOFOLLOW)
        finally:
            os.close(d)
        assert not (got := opens.opened()), f"opened: {got}"
    finally:
        opens.close()
    # A missing lock is made, a regular file of the agent's, and opened.
    fd = r.file("/smr/main/new.lock", os.O_RDONLY | os.O_NONBLOCK, create=0o644)
    try:
        assert stat.S_ISREG(os.fstat(fd).st_mode) and (main / "new.lock").is_file()
    finally:
        os.close(fd)
