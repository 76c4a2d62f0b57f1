"""What a container wrote to its writable layer, saved with its checkpoint
and put back into the replacement container before the restore.

Everything in the layer is the tenant's, and the agent is root on the host:

Saved: the overlayfs upperdir as a tar (files, directories, symlinks; an
overlay whiteout, a 0:0 character device, records a deleted file), walked
from directory descriptors (os.fwalk) and each file opened with O_NOFOLLOW
from its directory's: a directory the workload swaps for a symlink while it
is read can only ever expose the tenant's own files, never the host's.

Put back: by the agent itself, in a thread, *through* the new container's
root with openat2(RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS) (agent/confined).
No chroot into the image and no helper process: nothing of the image is
ever loaded (no NSS modules, no Python modules), and owners are the tar's
numbers, never names looked up anywhere.

Bounded: a file's holes (SEEK_DATA/SEEK_HOLE) are recorded, not written as
zeros (GNU tar's sparse format 1.0, which GNU tar and Python's tarfile read),
so a tenant's `truncate -s 10T` costs the node's disk what it costs the
tenant: its data. And the captures of one checkpoint write at most a
``Budget`` (the container's ephemeral-storage limit, else SMR_CAPTURE_BYTES),
checked before each member is written: over it, the checkpoint fails with
``capture-too-large`` and the workload runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from pathlib import Path

from services.containers.confined import Root, UnsafePath, open_regular_at
from smr.contract.errors import PermanentError

TAR = "rootfs.tar"
# The container's /dev/shm (its own tmpfs, not in the layer): POSIX shared
# memory (shm_open: PostgreSQL's dynamic shared memory, Python's
# multiprocessing.shared_memory) lives there, and CRIU saves a mapping of such
# a file as a reference to it, not its content.
SHM_TAR = "devshm.tar"
SHM = "dev/shm"
# Written by CRIU or the kubelet, not the workload's state.
_SKIP = {"smr", "etc/hosts", "etc/hostname", "etc/resolv.conf", "dev", "proc", "sys"}
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# The member name of a sparse file: its real name is the pax record
# GNU.sparse.name. Short and fixed, so that tarfile never adds a "path"
# record, which would override it when read.
_SPARSE_NAME = "GNUSparseFile.0/file"
_CHUNK = 1 << 20
TOO_LARGE = "capture-too-large"


def _block(n: int) -> int:
    return -(-n // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


class Budget:
    """The bytes the captures of one checkpoint (its layer and /dev/shm) may
    write together into the agent's work directory. Each member is counted,
    headers and all, before it is written: the work directory never holds
    more than ``limit``."""

    def __init__(self, limit: int, source: str) -> None:
        self.limit, self.source, self.used = limit, source, 0

    def left(self) -> int:
        return self.limit - self.used

    def take(self, n: int, what: str) -> None:
        if self.used + n > self.limit:
            raise PermanentError(
                f"the container's writable layer and /dev/shm take more than {self.limit} "
                f"bytes to save (reached at {what}), over the cap ({self.source}); nothing "
                "was stored and the workload keeps running", code=TOO_LARGE,
                hint="remove files the workload does not need from its writable layer or "
                     "/dev/shm (or keep them in a volume), or raise the container's "
                     "ephemeral-storage limit (SMR_CAPTURE_BYTES where it sets none)")
        self.used += n

    def tar(self, what: str) -> None:
        # A tar's end: two zero blocks, then zeros up to a whole record.
        self.take(2 * tarfile.RECORDSIZE, what)


def _skipped(rel: str) -> bool:
    return rel in _SKIP or rel.split("/", 1)[0] in _SKIP


def _info(rel: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(rel)
    info.mode, info.uid, info.gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
    info.mtime = int(st.st_mtime)
    return info


def _capture(upper: Path, out: Path, budget: Budget) -> None:
    top = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        budget.tar("the writable layer")
        with _writing(out) as tar:
            # fwalk opens each directory from its parent's descriptor and checks
            # it is the directory it listed: a swapped-in symlink is not entered.
            for rel_dir, dirnames, filenames, dfd in os.fwalk(".", dir_fd=top):
                for name in sorted(dirnames + filenames):
                    rel = os.path.normpath(os.path.join(rel_dir, name))
                    if not _skipped(rel):
                        _add(tar, dfd, name, rel, budget)
                dirnames[:] = [d for d in dirnames
                               if not _skipped(os.path.normpath(os.path.join(rel_dir, d)))]
    finally:
        os.close(top)


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[tarfile.TarFile]:
    """A tar written to ``out``, removed again if its capture fails (over
    the budget): a partial capture is never left on the node's disk."""
    try:
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
            yield tar
    except BaseException:
        out.unlink(missing_ok=True)
        raise


def _addfile(tar: tarfile.TarFile, info: tarfile.TarInfo, data: object, budget: Budget,
             rel: str) -> None:
    budget.take(len(info.tobuf(tar.format, tar.encoding, tar.errors)) + _block(info.size), rel)
    tar.addfile(info, data)  # type: ignore[arg-type]


def _add(tar: tarfile.TarFile, dfd: int, name: str, rel: str, budget: Budget) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return  # deleted while we read: the workload runs on (leave-running)
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        info = tarfile.TarInfo(rel)
        info.type = tarfile.CHRTYPE  # whiteout: deleted in this layer
        _addfile(tar, info, None, budget, rel)
    elif stat.S_ISDIR(st.st_mode):
        info = _info(rel, st)
        info.type = tarfile.DIRTYPE
        _addfile(tar, info, None, budget, rel)
    elif stat.S_ISLNK(st.st_mode):
        info = _info(rel, st)
        info.type = tarfile.SYMTYPE
        with contextlib.suppress(OSError):
            info.linkname = os.readlink(name, dir_fd=dfd)
            _addfile(tar, info, None, budget, rel)
    elif stat.S_ISREG(st.st_mode):
        try:
            fd = open_regular_at(dfd, name, _READ)  # O_PATH first: never a device
        except OSError:
            return  # replaced by a link or removed since: not a file of the layer now
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return
            info = _info(rel, st)
            regions = _data_regions(f.fileno(), st.st_size, budget, rel)
            if regions == [(0, st.st_size)] or st.st_size == 0:
                f.seek(0)  # lseek moved it
                info.size = st.st_size
                # A file that shrinks while read would make a short member; the
                # tar stays whole by padding (the workload runs on meanwhile).
                _addfile(tar, info, _Exactly(f, st.st_size), budget, rel)
                return
            sparse = _sparse_map(regions, st.st_size)
            info.name = _SPARSE_NAME
            info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                                "GNU.sparse.name": rel,
                                "GNU.sparse.realsize": str(st.st_size)}
            info.size = len(sparse) + sum(n for _, n in regions)
            _addfile(tar, info, _Regions(f.fileno(), sparse, regions), budget, rel)


def _data_regions(fd: int, size: int, budget: Budget, rel: str) -> list[tuple[int, int]]:
    """(offset, length) of each run of data in the file's first ``size``
    bytes: holes are skipped. Stops as soon as the data alone is over the
    budget (a map of a huge file is never built whole)."""
    regions: list[tuple[int, int]] = []
    pos = total = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:
                break  # only a hole from here on
            if e.errno == errno.EINVAL and pos == 0:
                return [(0, size)]  # a file system without holes
            raise
        if start >= size:
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        regions.append((start, end - start))
        total += end - start + 40  # with its line in the map, at most
        if total > budget.left():
            budget.take(total, rel)  # raises: over the cap
        pos = end
    return regions


def _sparse_map(regions: list[tuple[int, int]], size: int) -> bytes:
    """The map that starts a GNU sparse 1.0 member's data: the number of
    regions, then each one's offset and length, one number a line, padded
    to a block. A final empty region at the end marks a trailing hole (as
    GNU tar writes it)."""
    if not regions or sum(regions[-1]) < size:
        regions = [*regions, (size, 0)]
    text = f"{len(regions)}\n" + "".join(f"{o}\n{n}\n" for o, n in regions)
    data = text.encode()
    return data + b"\0" * (_block(len(data)) - len(data))


class _Exactly:
    """A file read as exactly ``size`` bytes (zeros if it shrank meanwhile)."""

    def __init__(self, f: object, size: int) -> None:
        self.f, self.left = f, size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        data = self.f.read(n)  # type: ignore[attr-defined]
        data += b"\0" * (n - len(data))
        self.left -= n
        return bytes(data)


class _Regions:
    """A sparse member's data: its map, then each data region as read now
    (zeros where the file shrank meanwhile)."""

    def __init__(self, fd: int, sparse: bytes, regions: list[tuple[int, int]]) -> None:
        self.fd, self.head, self.regions = fd, sparse, list(reversed(regions))

    def read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            if self.head:
                take = self.head[:n - len(out)]
                self.head = self.head[len(take):]
                out += take
                continue
            if not self.regions:
                break
            off, left = self.regions.pop()
            k = min(left, n - len(out), _CHUNK)
            data = os.pread(self.fd, k, off)
            out += data + b"\0" * (k - len(data))
            if left > k:
                self.regions.append((off + k, left - k))
        return bytes(out)


def _capture_shm(pid: int, out: Path, budget: Budget) -> None:
    with Root.of_pid(pid) as root:
        top = root.open(SHM, os.O_RDONLY | os.O_DIRECTORY)  # listed: not O_PATH
    try:
        if not os.listdir(top):
            return
        budget.tar(SHM)
        with _writing(out) as tar:
            for rel_dir, dirnames, filenames, dfd in os.fwalk(".", dir_fd=top):
                for name in sorted(dirnames + filenames):
                    _add(tar, dfd, name, os.path.normpath(os.path.join(SHM, rel_dir, name)),
                         budget)
    finally:
        os.close(top)


def _walked_bytes(top: int, skip: bool, cap: int) -> int:
    total = 0
    for rel_dir, dirnames, filenames, dfd in os.fwalk(".", dir_fd=top):
        for name in dirnames + filenames:
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if skip and _skipped(rel):
                continue
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            total += 3 * tarfile.BLOCKSIZE  # its headers, at most for most names
            if stat.S_ISREG(st.st_mode):
                total += _block(min(st.st_size, st.st_blocks * 512))  # its data, not holes
            if total >= cap:
                return cap
        if skip:
            dirnames[:] = [d for d in dirnames
                           if not _skipped(os.path.normpath(os.path.join(rel_dir, d)))]
    return total


def saved_bytes(upper: Path | None, pid: int, cap: int) -> int:
    """About what the captures of the container of ``pid`` (its smr-init),
    with writable layer ``upper``, will write now, at most ``cap``: each
    file's data (its apparent size less its holes) and headers. For the
    checkpoint's admission (services/checkpointer/admission)."""
    total = 0
    with contextlib.suppress(OSError, UnsafePath):
        if upper is not None:
            top = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                total += _walked_bytes(top, True, cap)
            finally:
                os.close(top)
        with Root.of_pid(pid) as root:
            top = root.open(SHM, os.O_RDONLY | os.O_DIRECTORY)
        try:
            total += _walked_bytes(top, False, cap)
        finally:
            os.close(top)
    return min(total, cap)


async def capture_shm(pid: int, out: Path, budget: Budget) -> None:
    """Tar the files in /dev/shm of the container of ``pid`` (its smr-init),
    read through its root like the layer is put back (never a link followed),
    into ``out``, within ``budget``; nothing is written when it is empty."""
    try:
        await asyncio.to_thread(_capture_shm, pid, out, budget)
    except (FileNotFoundError, NotADirectoryError, UnsafePath):
        return  # no /dev/shm of its own (or not a directory): nothing to carry


async def capture(upper: Path, out: Path, budget: Budget) -> None:
    """Tar ``upper`` (the container's writable layer) into ``out``, within ``budget``."""
    if not upper.is_dir():
        raise PermanentError(f"the container's writable layer {upper} is not readable",
                             code="rootfs-unreadable",
                             hint="the agent needs the container runtime's state directory "
                                  "(/var/lib/containerd) mounted")
    await asyncio.to_thread(_capture, upper, out, budget)


def _member_path(name: str) -> tuple[str, str]:
    """(parent, name) of a member, refusing anything that climbs."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise UnsafePath(f"{name!r} in the checkpoint's writable layer climbs out of it",
                         hint="the checkpoint was not written by smr")
    return "/".join(parts[:-1]), parts[-1]


def _remove(dfd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dfd)  # fd-based: never follows a link out
    else:
        os.unlink(name, dir_fd=dfd)


def _apply_member(root: Root, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
    parent, name = _member_path(m.name)
    with root.dir(parent) as d:
        if m.type == tarfile.CHRTYPE:  # a whiteout: deleted in the layer
            _remove(d, name)
            return
        if m.isdir():
            existed = True
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    _remove(d, name)
                    raise FileNotFoundError
            except FileNotFoundError:
                os.mkdir(name, 0o700, dir_fd=d)
                existed = False
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                         dir_fd=d)
            try:
                os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, m.mode & 0o7777)
            except OSError as e:
                # A directory the new container already has, mounted read-only
                # there (a volume, the runtime's bind mount of a driver or a
                # toolkit): its owner and mode are the mount's, not the layer's.
                if not (existed and e.errno in (errno.EROFS, errno.EPERM)):
                    raise
            finally:
                os.close(fd)
        elif m.issym():
            _remove(d, name)
            os.symlink(m.linkname, name, dir_fd=d)
            os.chown(name, m.uid, m.gid, dir_fd=d, follow_symlinks=False)
        elif m.isreg():
            _remove(d, name)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=d)
            try:
                if m.sparse is not None:
                    _write_sparse(tar, m, fd)
                else:
                    src = tar.extractfile(m)
                    assert src is not None
                    while chunk := src.read(_CHUNK):
                        os.write(fd, chunk)
                os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, m.mode & 0o7777)  # after chown, which clears set-id bits
                os.utime(fd, (m.mtime, m.mtime))
            finally:
                os.close(fd)
        # Anything else (hard links, devices, FIFOs) smr never saves: skipped.


def _write_sparse(tar: tarfile.TarFile, m: tarfile.TarInfo, fd: int) -> None:
    """A GNU sparse 1.0 member written as sparse as it was saved: each data
    region at its offset, the holes left holes, the file made its real size.
    Read from the stream directly: tarfile would read every hole as zeros,
    and its own size for a member of more than 8 GiB of data is the
    archive's, not the file's."""
    assert m.sparse is not None and m.offset_data is not None
    try:
        size = int(m.pax_headers["GNU.sparse.realsize"])
    except (KeyError, ValueError):
        raise UnsafePath(f"{m.name!r} in the checkpoint's writable layer is sparse with no "
                         "size", hint="the checkpoint was not written by smr") from None
    end = 0
    for off, n in m.sparse:
        if off < end or n < 0 or off + n > size:
            raise UnsafePath(f"{m.name!r} in the checkpoint's writable layer has a sparse "
                             "map out of order", hint="the checkpoint was not written by smr")
        end = off + n
    src = tar.fileobj
    assert src is not None
    src.seek(m.offset_data)
    data = 0
    for off, n in m.sparse:
        while n:
            chunk = src.read(min(n, _CHUNK))
            if not chunk:
                raise tarfile.ReadError(f"{m.name!r} in the checkpoint's writable layer "
                                        "is cut short")
            os.pwrite(fd, chunk, off)
            off, n, data = off + len(chunk), n - len(chunk), data + len(chunk)
    os.ftruncate(fd, size)
    # The next member starts after this one's data (its map was read before
    # offset_data): set here, as tarfile's own sum is wrong past 8 GiB.
    tar.offset = m.offset_data + _block(data)


def _apply_to(root: Root, tar_path: Path) -> None:
    with tarfile.open(tar_path, "r|") as tar:
        for m in tar:
            try:
                _apply_member(root, tar, m)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise
                raise PermanentError(
                    f"could not put {m.name} of the checkpoint's writable layer back into "
                    f"{root.name}: {e.strerror}", code="rootfs-restore-failed") from None


def _apply(tar_path: Path, pid: int) -> None:
    with Root.of_pid(pid) as root:
        _apply_to(root, tar_path)


async def apply(tar: Path, pid: int) -> None:
    """Put the saved layer (or /dev/shm, SHM_TAR) back into the container of
    ``pid`` (its smr-init)."""
    if not tar.is_file():
        return  # a checkpoint without a layer (nothing was written)
    await asyncio.to_thread(_apply, tar, pid)
