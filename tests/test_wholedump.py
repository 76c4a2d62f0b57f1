"""A dump on disk is judged whole from its headers alone: each page image
as long as its pagemaps say, the process tree's images all there and read
through. Real CRIU dumps a process with a thread and a shared anonymous
mapping (a page image of its own, pagemap-shmem); each case then damages a
copy as a crash would."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from smr.process.criu import Criu
from smr.process.wholedump import torn

pytestmark = pytest.mark.criu

WORKLOAD = """
import mmap, sys, threading, time
heap = bytearray(8 << 20)
shared = mmap.mmap(-1, 4 << 20)
shared.write(b"x" * (4 << 20))
threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
print("ready", flush=True)
time.sleep(1000)
"""


@pytest.fixture(scope="module")
def dumped(criu_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    images = tmp_path_factory.mktemp("wholedump") / "images"
    dump(criu_binary, WORKLOAD, images)
    return images


def dump(criu_binary: str, workload: str, images: Path, *, prefix: tuple[str, ...] = (),
         pre_dump: bool = False) -> None:
    """Real CRIU dumps ``workload`` (Python source, run under ``prefix``) into
    ``images`` once it says ready, leaving it running; it is killed after.
    ``pre_dump``: a pre-dump first (beside ``images``), then a line on its
    stdin, and the dump once it says ready again."""

    async def run() -> None:
        p = await asyncio.create_subprocess_exec(
            *prefix, sys.executable, "-c", workload, stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            assert p.stdout and p.stdin
            assert (await p.stdout.readline()).strip() == b"ready"
            criu = Criu(criu_binary)
            parent = None
            if pre_dump:
                parent = images.parent / "pre"
                parent.mkdir(parents=True)
                await criu.pre_dump(p.pid, parent)
                p.stdin.write(b"go\n")
                await p.stdin.drain()
                assert (await p.stdout.readline()).strip() == b"ready"
            images.mkdir(parents=True, exist_ok=True)
            await criu.dump(p.pid, images, leave_running=True, parent=parent)
        finally:
            # The whole group: a workload's forked children would otherwise
            # outlive it, holding this test's pipe open.
            os.killpg(p.pid, signal.SIGKILL)
            await p.wait()

    asyncio.run(run())


def _largest(images: Path, pattern: str) -> Path:
    return max(images.glob(pattern), key=lambda p: p.stat().st_size)


def _cut(path: Path, by: int) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - by)


def _shmem_pages(images: Path) -> Path:
    # The shared mapping's page image is the one the shmem pagemap names:
    # the smaller of the two here (4 MiB against the heap's 8 and more).
    return min(images.glob("pages-*.img"), key=lambda p: p.stat().st_size)


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "page image cut by a page": (
        lambda d: _cut(_largest(d, "pages-*.img"), 4096), "where its pagemaps describe"),
    "page image cut by a MiB": (
        lambda d: _cut(_largest(d, "pages-*.img"), 1 << 20), "where its pagemaps describe"),
    "page image empty": (
        lambda d: _largest(d, "pages-*.img").open("r+b").truncate(0), "holds 0 bytes"),
    "shared memory's page image cut": (
        lambda d: _cut(_shmem_pages(d), 4096), "where its pagemaps describe"),
    "page image missing": (
        lambda d: _shmem_pages(d).unlink(), "holds no file"),
    "page image longer": (
        lambda d: _largest(d, "pages-*.img").open("ab").write(b"\0" * 4096),
        "where its pagemaps describe"),
    "pagemap cut inside a record": (
        lambda d: _cut(_largest(d, "pagemap-[0-9]*.img"), 3), "inside a record"),
    "a thread's core missing": (
        lambda d: min(d.glob("core-*.img"), key=lambda p: p.stat().st_size).unlink(),
        "is missing (pstree.img names thread"),
    "pstree empty": (lambda d: (d / "pstree.img").open("r+b").truncate(0), "pstree.img"),
    "inventory missing": (lambda d: (d / "inventory.img").unlink(), "inventory.img is missing"),
    "memory layout empty": (
        lambda d: next(d.glob("mm-*.img")).open("r+b").truncate(0), "not even its magic"),
    "files cut inside a record": (lambda d: _cut(d / "files.img", 3), "inside a record"),
    "descriptors cut inside a record": (
        lambda d: _cut(next(d.glob("fdinfo-*.img")), 3), "inside a record"),
}


def test_a_whole_dump_is_whole(dumped: Path) -> None:
    assert len(list(dumped.glob("pages-*.img"))) == 2, "expected the heap's and the shmem's"
    assert len(list(dumped.glob("core-*.img"))) == 2, "expected two threads"
    assert torn(dumped) is None


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_dump_is_named_torn(dumped: Path, tmp_path: Path, case: str) -> None:
    damage, says = DAMAGE[case]
    copy = tmp_path / "images"
    shutil.copytree(dumped, copy)
    damage(copy)
    why = torn(copy)
    assert why is not None and says in why, f"{case}: {why!r}"


def test_a_pre_dump_parent_is_checked_too(dumped: Path, tmp_path: Path) -> None:
    """The pages a dump references in its pre-dump are part of its restore:
    a pre-dump (its ``parent`` link, inside the work directory) cut short
    makes the dump torn; one outside the work directory is not followed."""
    work = tmp_path / "work"
    shutil.copytree(dumped, work / "pre")
    shutil.copytree(dumped, work / "images")
    (work / "images" / "parent").symlink_to("../pre")
    assert torn(work / "images") is None
    _cut(_largest(work / "pre", "pages-*.img"), 4096)
    why = torn(work / "images")
    assert why is not None and "in its pre-dump" in why, why
    outside = tmp_path / "elsewhere"
    (work / "pre").rename(outside)
    (work / "images" / "parent").unlink()
    (work / "images" / "parent").symlink_to(outside)
    assert torn(work / "images") is None


ZOMBIE_WORKLOAD = """
import os, subprocess, time
child = subprocess.Popen(["true"])  # exits at once, never waited for: a zombie child
while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
    time.sleep(0.01)  # a loaded machine may not have run it to its end yet
print("ready", flush=True)
time.sleep(1000)
"""


def test_a_tree_holding_a_zombie_is_whole(criu_binary: str, tmp_path: Path) -> None:
    """CRIU dumps a zombie with its own core (its state dead) and lists for
    it a thread that is none (an unset number, no core of its own): a whole
    dump of a tree holding one is whole. Its core missing is still torn."""
    images = tmp_path / "images"
    dump(criu_binary, ZOMBIE_WORKLOAD, images)
    assert len(list(images.glob("core-*.img"))) == 2, "expected the process's and its zombie's"
    assert torn(images) is None
    zombie = min(images.glob("core-*.img"), key=lambda p: p.stat().st_size)
    zombie.unlink()
    why = torn(images)
    assert why is not None and f"{zombie.name} is missing" in why, why


HEAVY_WORKLOAD = """
import mmap, os, signal, socket, tempfile, threading, time
r, w = os.pipe()
os.write(w, b"queued in a pipe" * 100)
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
a.sendall(b"queued on a stream pair" * 100)
c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
for _ in range(5):
    c.send(b"a datagram")
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("127.0.0.1", 0))
efd = os.eventfd(7)
signal.signal(signal.SIGALRM, lambda *_: None)
signal.setitimer(signal.ITIMER_REAL, 500, 500)
work = tempfile.mkdtemp()
with open(os.path.join(work, "mapped"), "wb") as f:
    f.write(os.urandom(3 << 20))
mapped_file = open(os.path.join(work, "mapped"), "r+b")
mapped = mmap.mmap(mapped_file.fileno(), 2 << 20)
ghost = open(os.path.join(work, "ghost"), "w+b")
ghost.write(b"deleted but open" * 1000)
ghost.flush()
os.unlink(os.path.join(work, "ghost"))
for _ in range(4):
    threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
children = []
for i in range(3):
    cr, cw = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(cw, b"child %d" % i)
        time.sleep(1000)
        os._exit(0)
    children.append((pid, cr, cw))
time.sleep(0.2)
print("ready", flush=True)
time.sleep(1000)
"""


def test_a_heavy_process_dumps_whole(criu_binary: str, tmp_path: Path) -> None:
    """A process holding what real programs hold (queued pipe and socket
    data, listening TCP and bound UDP sockets, an eventfd, a running timer,
    a mapped file, a deleted file still open, threads, forked children)
    dumps whole: nothing in a real dump of it is taken for a cut."""
    images = tmp_path / "images"
    dump(criu_binary, HEAVY_WORKLOAD, images)
    assert len(list(images.glob("pstree.img"))) == 1
    assert len(list(images.glob("core-*.img"))) == 4 + 1 + 3, "expected 5 threads and 3 children"
    assert torn(images) is None
