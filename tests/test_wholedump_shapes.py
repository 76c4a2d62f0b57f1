"""Real CRIU dumps of more process shapes (memfds, tens of thousands of
mappings, mappings past a file's end, huge pages, hundreds of threads, SysV
shared memory, a pre-dump chain, a deleted file held open): torn() calls each
whole, and a cut where CRIU keeps a length of its own torn."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from smr.process.criu import Criu
from smr.process.wholedump import torn
from tests.test_wholedump import dump

pytestmark = pytest.mark.criu

MEMFD = """
import mmap, os, time
a = os.memfd_create("mapped")
os.write(a, os.urandom(3 << 20))
ma = mmap.mmap(a, 3 << 20)                       # shared mapping of a memfd
b = os.memfd_create("held")
os.write(b, b"only held" * 100000)               # held, never mapped
c = os.memfd_create("private")
os.write(c, os.urandom(1 << 20))
mc = mmap.mmap(c, 1 << 20, flags=mmap.MAP_PRIVATE)
mc[:4096] = b"w" * 4096                          # a COW page of a private memfd mapping
print("ready", flush=True)
time.sleep(1000)
"""

MANY_VMAS = """
import ctypes, mmap, time
maps = []
for i in range(20000):  # Python's anonymous mmap is MAP_SHARED: 20000 shmem objects
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | (mmap.PROT_WRITE if i % 2 else 0))
    if i % 2:
        m[0] = 1
    maps.append(m)
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
base = libc.mmap(None, 40000 * 4096, 3, 0x22, -1, 0)  # one private region cut into 40000 VMAs
for i in range(0, 40000, 2):
    ctypes.memset(base + i * 4096, 1, 8)
    libc.mprotect(base + i * 4096, 4096, 1)
print("ready", flush=True)
time.sleep(1000)
"""

BEYOND_EOF = """
import mmap, os, tempfile, time
d = tempfile.mkdtemp()
f = open(os.path.join(d, "short"), "w+b")
f.write(b"s" * 5000); f.flush()
import ctypes, ctypes.util
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
# 4 pages over a file of 5000 bytes: pages 2 and 3 lie beyond EOF (SIGBUS if touched)
sh = libc.mmap(None, 4 * 4096, 3, 1, f.fileno(), 0)      # MAP_SHARED
pr = libc.mmap(None, 4 * 4096, 3, 2, f.fileno(), 0)      # MAP_PRIVATE
assert sh not in (None, ctypes.c_void_p(-1).value) and pr not in (None, ctypes.c_void_p(-1).value)
ctypes.memset(pr, 0x70, 4096)                              # COW page 0
ctypes.memset(pr + 4096, 0x71, 100)                        # COW page 1 (partly past EOF)
_ = ctypes.string_at(sh, 4096)
zero = libc.mmap(None, 64 * 4096, 3, 0x22, -1, 0)         # anonymous, only read: zero page
_ = ctypes.string_at(zero, 64 * 4096)
huge = libc.mmap(None, 8 << 20, 3, 0x22, -1, 0)
libc.madvise(ctypes.c_void_p(huge), ctypes.c_size_t(8 << 20), 14)  # MADV_HUGEPAGE
ctypes.memset(huge, 1, 8 << 20)
print("ready", flush=True)
time.sleep(1000)
"""

THREADS = """
import threading, time
for _ in range(300):
    threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()
print("ready", flush=True)
time.sleep(1000)
"""

SYSV_SHM = """
import ctypes, time, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
ids = []
for size in (1 << 20, 3 << 20 | 123):
    shmid = libc.shmget(0, size, 0o1600)                   # IPC_PRIVATE, IPC_CREAT
    assert shmid >= 0, ctypes.get_errno()
    addr = libc.shmat(shmid, None, 0)
    ctypes.memset(addr, 0x5a, size // 2)
    ids.append(shmid)
nomap = libc.shmget(0, 2 << 20, 0o1600)                    # a segment no one maps
a = libc.shmat(nomap, None, 0); ctypes.memset(a, 7, 1 << 20); libc.shmdt(ctypes.c_void_p(a))
print("ready", flush=True)
time.sleep(1000)
"""

PRE_DUMP = """
import mmap, os, sys, time
heap = bytearray(os.urandom(16 << 20))
shared = mmap.mmap(-1, 4 << 20)
shared.write(os.urandom(4 << 20))
print("ready", flush=True)
sys.stdin.readline()
for i in range(0, len(heap), 3 * 4096):   # dirty a third of the heap after the pre-dump
    heap[i] = 1
shared[:4096] = b"z" * 4096
print("ready", flush=True)
time.sleep(1000)
"""


@pytest.mark.parametrize("shape", ["MEMFD", "MANY_VMAS", "BEYOND_EOF", "THREADS"])
def test_shape_dumps_whole(criu_binary: str, tmp_path: Path, shape: str) -> None:
    images = tmp_path / "images"
    dump(criu_binary, globals()[shape], images)
    assert torn(images) is None, sorted(p.name for p in images.iterdir())


def test_sysv_shm_in_its_own_ipc_namespace_dumps_whole(criu_binary: str,
                                                       tmp_path: Path) -> None:
    images = tmp_path / "images"
    dump(criu_binary, SYSV_SHM, images, prefix=("unshare", "--ipc"))
    assert list(images.glob("pagemap-shmem-*.img")) or list(images.glob("ipcns-shm-*.img"))
    assert torn(images) is None, sorted(p.name for p in images.iterdir())


def test_a_real_pre_dump_chain_is_whole(criu_binary: str, tmp_path: Path) -> None:
    if not asyncio.run(Criu(criu_binary).tracks_memory()):
        pytest.skip("this kernel tracks no dirty memory (soft-dirty): no pre-dump")
    images = tmp_path / "work" / "images"
    dump(criu_binary, PRE_DUMP, images, pre_dump=True)
    assert (images / "parent").is_symlink()
    assert torn(images) is None


GHOST = """
import os, tempfile, time
d = tempfile.mkdtemp()
f = open(os.path.join(d, "deleted"), "w+b")
f.write(b"A" * 100000)  # past CRIU's 12 KiB: saved in chunks, its size recorded
f.flush()
os.unlink(os.path.join(d, "deleted"))
print("ready", flush=True)
time.sleep(1000)
"""


def test_a_cut_ghost_file_image_is_torn(criu_binary: str, tmp_path: Path) -> None:
    """A deleted file still open is saved in ghost-file-N.img: GhostFileEntry
    (chunks, size), then each GhostChunkEntry(len, off) followed by len raw
    bytes. Cut inside those bytes (a crash losing its tail), CRIU's restore
    spins for ever in copy_chunk_to_file (sendfile returns 0, len never
    shrinks; seen: 4 min at 100% CPU, restore.log stopped at the ghost's
    remap) until smr's CRIU timeout. torn() reads none of it: it calls the
    dump whole. The entry records every length, so the cut can be seen."""
    images = tmp_path / "images"
    dump(criu_binary, GHOST, images)
    ghost = max(images.glob("ghost-file-*.img"), key=lambda p: p.stat().st_size)
    assert ghost.stat().st_size > 100000
    assert torn(images) is None
    with ghost.open("r+b") as f:
        f.truncate(ghost.stat().st_size - 4096)
    assert torn(images) is not None, "a ghost file image cut inside its data is called whole"


GHOST_HEAD = """
import os, tempfile, time, fcntl
d = tempfile.mkdtemp(dir=os.environ.get("GHOST_DIR", "/tmp"))
held = []
def ghost(name, body):
    p = os.path.join(d, name)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    body(fd)
    os.fsync(fd)
    os.unlink(p)
    held.append(fd)
"""
GHOST_TAIL = """
print("ready", flush=True)
time.sleep(1000)
"""
GHOST_SHAPES = {
    "sparse_two_places": """
def b(fd):
    os.ftruncate(fd, 10 << 20)
    os.pwrite(fd, b"A" * 4096, 0)
    os.pwrite(fd, b"B" * 100, (8 << 20) + 123)
ghost("sparse", b)
""",
    "empty": "ghost('empty', lambda fd: None)\n",
    "truncated_larger": """
def b(fd):
    os.write(fd, b"C" * 100)
ghost("grow", b)
os.ftruncate(held[-1], 1 << 20)   # after the unlink
os.pwrite(held[-1], b"D" * 10, (1 << 20) - 10)
os.ftruncate(held[-1], 3 << 20)
""",
    "exactly_threshold": "ghost('t', lambda fd: os.write(fd, b'E' * 12288))\n",
    "threshold_plus_one": "ghost('t1', lambda fd: os.write(fd, b'F' * 12289))\n",
    "prealloc_past_eof": """
def b(fd):
    os.write(fd, b"G" * 20000)
    import ctypes  # fallocate(FALLOC_FL_KEEP_SIZE): blocks past the end of file
    ctypes.CDLL(None).fallocate(fd, 1, ctypes.c_long(0), ctypes.c_long(1 << 20))
ghost("pre", b)
""",
    "unwritten_extents": "ghost('u', lambda fd: os.posix_fallocate(fd, 0, 65536))\n",
    "many_extents": """
def b(fd):
    os.ftruncate(fd, 700 * 65536 + 5)
    for i in range(700):
        os.pwrite(fd, b"H" * 4096, i * 65536)
ghost("many", b)
""",
    "directory": """
p = os.path.join(d, "sub"); os.mkdir(p); held.append(os.open(p, os.O_RDONLY)); os.rmdir(p)
""",
    "fifo": """
p = os.path.join(d, "fifo"); os.mkfifo(p); held.append(os.open(p, os.O_RDWR)); os.unlink(p)
""",
    "mapped_only": """
import mmap
p = os.path.join(d, "m"); fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 1 << 20); os.pwrite(fd, b"I" * 5000, 300000)
m = mmap.mmap(fd, 1 << 20); os.close(fd); os.unlink(p)
""",
}


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
@pytest.mark.parametrize("shape", sorted(GHOST_SHAPES))
def test_a_real_ghost_file_shape_is_whole(criu_binary: str, tmp_path: Path, shape: str,
                                          where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleted files held open, as CRIU saves them on ext4 (extents through
    fiemap) and on tmpfs (SEEK_DATA): sparse, empty, grown after the unlink,
    at the chunk threshold, preallocated past the end, hundreds of extents,
    a directory, a fifo, one held only through a mapping. Each dump is whole."""
    monkeypatch.setenv("GHOST_DIR", where)
    images = tmp_path / "images"
    dump(criu_binary, GHOST_HEAD + GHOST_SHAPES[shape] + GHOST_TAIL, images)
    assert list(images.glob("ghost-file-*.img")) or shape == "fifo", "no ghost image"
    assert torn(images) is None
