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
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import stat
import tarfile
from pathlib import Path

from services.containers.confined import Root, UnsafePath, open_regular_at
from smr.errors import PermanentError

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


def _skipped(rel: str) -> bool:
    return rel in _SKIP or rel.split("/", 1)[0] in _SKIP


def _info(rel: str, st: os.stat_result) -> tarfile.TarInfo:
    info = tarfile.TarInfo(rel)
    info.mode, info.uid, info.gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
    info.mtime = int(st.st_mtime)
    return info


def _capture(upper: Path, out: Path) -> None:
    top = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
            # fwalk opens each directory from its parent's descriptor and checks
            # it is the directory it listed: a swapped-in symlink is not entered.
            for rel_dir, dirnames, filenames, dfd in os.fwalk(".", dir_fd=top):
                for name in sorted(dirnames + filenames):
                    rel = os.path.normpath(os.path.join(rel_dir, name))
                    if not _skipped(rel):
                        _add(tar, dfd, name, rel)
                dirnames[:] = [d for d in dirnames
                               if not _skipped(os.path.normpath(os.path.join(rel_dir, d)))]
    finally:
        os.close(top)


def _add(tar: tarfile.TarFile, dfd: int, name: str, rel: str) -> None:
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return  # deleted while we read: the workload runs on (leave-running)
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        info = tarfile.TarInfo(rel)
        info.type = tarfile.CHRTYPE  # whiteout: deleted in this layer
        tar.addfile(info)
    elif stat.S_ISDIR(st.st_mode):
        info = _info(rel, st)
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    elif stat.S_ISLNK(st.st_mode):
        info = _info(rel, st)
        info.type = tarfile.SYMTYPE
        with contextlib.suppress(OSError):
            info.linkname = os.readlink(name, dir_fd=dfd)
            tar.addfile(info)
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
            info.size = st.st_size
            # A file that shrinks while read would make a short member; the
            # tar stays whole by padding (the workload runs on meanwhile).
            tar.addfile(info, _Exactly(f, st.st_size))


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


def _capture_shm(pid: int, out: Path) -> None:
    with Root.of_pid(pid) as root:
        top = root.open(SHM, os.O_RDONLY | os.O_DIRECTORY)  # listed: not O_PATH
    try:
        if not os.listdir(top):
            return
        with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
            for rel_dir, dirnames, filenames, dfd in os.fwalk(".", dir_fd=top):
                for name in sorted(dirnames + filenames):
                    _add(tar, dfd, name, os.path.normpath(os.path.join(SHM, rel_dir, name)))
    finally:
        os.close(top)


async def capture_shm(pid: int, out: Path) -> None:
    """Tar the files in /dev/shm of the container of ``pid`` (its smr-init),
    read through its root like the layer is put back (never a link followed),
    into ``out``; nothing is written when it is empty."""
    try:
        await asyncio.to_thread(_capture_shm, pid, out)
    except (FileNotFoundError, NotADirectoryError, UnsafePath):
        return  # no /dev/shm of its own (or not a directory): nothing to carry


async def capture(upper: Path, out: Path) -> None:
    """Tar ``upper`` (the container's writable layer) into ``out``."""
    if not upper.is_dir():
        raise PermanentError(f"the container's writable layer {upper} is not readable",
                             code="rootfs-unreadable",
                             hint="the agent needs the container runtime's state directory "
                                  "(/var/lib/containerd) mounted")
    await asyncio.to_thread(_capture, upper, out)


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
                src = tar.extractfile(m)
                assert src is not None
                while chunk := src.read(1 << 20):
                    os.write(fd, chunk)
                os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, m.mode & 0o7777)  # after chown, which clears set-id bits
                os.utime(fd, (m.mtime, m.mtime))
            finally:
                os.close(fd)
        # Anything else (hard links, devices, FIFOs) smr never saves: skipped.


def _apply(tar_path: Path, pid: int) -> None:
    with Root.of_pid(pid) as root, tarfile.open(tar_path, "r|") as tar:
        for m in tar:
            try:
                _apply_member(root, tar, m)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise
                raise PermanentError(
                    f"could not put {m.name} of the checkpoint's writable layer back into "
                    f"{root.name}: {e.strerror}", code="rootfs-restore-failed") from None


async def apply(tar: Path, pid: int) -> None:
    """Put the saved layer (or /dev/shm, SHM_TAR) back into the container of
    ``pid`` (its smr-init)."""
    if not tar.is_file():
        return  # a checkpoint without a layer (nothing was written)
    await asyncio.to_thread(_apply, tar, pid)
