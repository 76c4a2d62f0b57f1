"""A container's writable layer and /dev/shm are saved as what they cost the
tenant, not as what they claim to be: a 1 TiB sparse file (one `truncate`)
is saved as its few bytes of data and comes back with its holes, and the
captures of one checkpoint stop at their cap before writing past it.

The captures are written into a small tmpfs here: a capture that wrote holes
as zeros would fill it (ENOSPC) instead of the node's disk."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.containers import rootfs
from services.containers.confined import Root
from smr.contract.errors import PermanentError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")

TIB = 1 << 40
# (offset, data) written into the sparse file: the rest is holes.
DATA = [(0, b"head of the file\n"), (TIB // 2, b"in the middle\n"), (TIB - 4096, b"near the end")]


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """The agent's work directory for the test: a 32 MiB tmpfs."""
    d = tmp_path / "work"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "smr-test", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def sparse_file(path: Path, size: int = TIB) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
        for off, data in DATA:
            if off < size:
                f.seek(off)
                f.write(data)


def restored_into(tar: Path, into: Path) -> None:
    into.mkdir(exist_ok=True)
    with Root(os.open(into, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), "a test root") as r:
        rootfs._apply_to(r, tar)


def assert_same_sparse(path: Path) -> None:
    st = path.stat()
    assert st.st_size == TIB, f"restored as {st.st_size} bytes, not its apparent {TIB}"
    assert st.st_blocks * 512 < 1 << 20, (
        f"restored with {st.st_blocks * 512} bytes allocated: its holes were written")
    with open(path, "rb") as f:
        for off, data in DATA:
            f.seek(off)
            assert f.read(len(data)) == data
        f.seek(TIB // 4)
        assert f.read(4096) == b"\0" * 4096


def test_a_sparse_terabyte_in_the_layer_is_saved_as_its_data_and_restored_with_its_holes(
        tmp_path: Path, scratch: Path) -> None:
    upper = tmp_path / "upper"
    sparse_file(upper / "data" / "huge")
    (upper / "data" / "small").write_bytes(b"x" * 10000)
    out = scratch / rootfs.TAR
    rootfs._capture(upper, out, rootfs.Budget(16 << 20, "a test cap"))
    assert out.stat().st_size < 1 << 20, f"the capture wrote {out.stat().st_size} bytes"
    restored_into(out, tmp_path / "new")
    assert_same_sparse(tmp_path / "new" / "data" / "huge")
    assert (tmp_path / "new" / "data" / "small").read_bytes() == b"x" * 10000
    if tar := shutil.which("tar"):  # the format is GNU tar's own: it reads the real name
        listed = subprocess.run([tar, "-tvf", str(out)], capture_output=True, text=True,
                                check=True).stdout
        assert f" {TIB} " in listed and "data/huge" in listed, listed


@contextlib.contextmanager
def with_own_shm(tmp_path: Path, *commands: str) -> Iterator[int]:
    """The pid of a process with a /dev/shm of its own (a tmpfs in its own
    mount namespace), as a container's is, after ``commands`` ran in it."""
    ready = tmp_path / "ready"
    script = " && ".join(["mount -t tmpfs -o size=16m shm /dev/shm", *commands,
                          f"touch {ready}", "exec sleep 60"])
    p = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script])
    try:
        deadline = time.monotonic() + 10
        while not ready.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the process did not start"
            time.sleep(0.05)
        yield p.pid
    finally:
        p.kill()
        p.wait()


SPARSE_IN_SHM = [f"truncate -s {TIB} /dev/shm/huge",
                 *(f"printf '{data.decode()}' | dd of=/dev/shm/huge bs=1 seek={off} "
                   "conv=notrunc status=none" for off, data in DATA)]


def test_a_sparse_terabyte_in_dev_shm_is_saved_as_its_data_and_restored_with_its_holes(
        tmp_path: Path, scratch: Path) -> None:
    out = scratch / rootfs.SHM_TAR
    with with_own_shm(tmp_path, *SPARSE_IN_SHM) as pid:
        rootfs._capture_shm(pid, out, rootfs.Budget(16 << 20, "a test cap"))
    assert out.stat().st_size < 1 << 20, f"the capture wrote {out.stat().st_size} bytes"
    (tmp_path / "new" / rootfs.SHM).mkdir(parents=True)  # the new container's own
    restored_into(out, tmp_path / "new")
    assert_same_sparse(tmp_path / "new" / rootfs.SHM / "huge")


def test_the_admission_estimate_counts_the_data_of_the_layer_and_dev_shm_not_holes(
        tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    sparse_file(upper / "huge")
    (upper / "dense").write_bytes(os.urandom(4 << 20))
    with with_own_shm(tmp_path, *SPARSE_IN_SHM,
                      "head -c 2097152 /dev/urandom > /dev/shm/dense") as pid:
        n = rootfs.saved_bytes(upper, pid, 1 << 30)
        assert 6 << 20 <= n < 7 << 20, f"estimated {n} bytes for 6 MiB of data"
        assert rootfs.saved_bytes(upper, pid, 5 << 20) == 5 << 20  # at most the cap


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_layer_over_its_cap_fails_with_its_own_code_and_writes_nothing_past_it(
        tmp_path: Path, scratch: Path, sparse: bool) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "a-small-file").write_bytes(b"kept")
    big = upper / "big"
    if sparse:  # its data alone is over the cap: 8 MiB written at 1 TiB
        sparse_file(big)
        with open(big, "r+b") as f:
            f.seek(TIB // 3)
            f.write(os.urandom(8 << 20))
    else:
        big.write_bytes(os.urandom(8 << 20))
    out = scratch / rootfs.TAR
    with pytest.raises(PermanentError) as e:
        rootfs._capture(upper, out, rootfs.Budget(4 << 20, "a test cap"))
    assert e.value.code == "capture-too-large"
    assert "a test cap" in str(e.value) and "keeps running" in str(e.value)
    assert not out.exists(), "a capture over its cap was left in the work directory"


def test_a_sparse_member_is_read_back_by_pythons_tarfile_too(tmp_path: Path,
                                                            scratch: Path) -> None:
    """The tar is GNU sparse 1.0 as tarfile reads it: the next member after a
    sparse one is found where it is."""
    upper = tmp_path / "upper"
    sparse_file(upper / "a", size=1 << 30)
    (upper / "b").write_bytes(b"after the sparse one")
    out = scratch / rootfs.TAR
    rootfs._capture(upper, out, rootfs.Budget(16 << 20, "a test cap"))
    with tarfile.open(out) as t:
        a = t.getmember("a")
        assert a.issparse() and a.size == 1 << 30
        f = t.extractfile("b")
        assert f is not None and f.read() == b"after the sparse one"
