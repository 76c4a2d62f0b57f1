"""Opening files inside a tenant's container without following anything the
tenant controls.

The agent reaches a container's files through /proc/<pid>/root, but every
name under it belongs to the tenant: a symlink there resolves from the
*agent's* root (the host), a FIFO blocks a reader forever. So every path
under a container's root is opened with openat2(RESOLVE_IN_ROOT |
RESOLVE_NO_SYMLINKS) from a descriptor of that root: ``..`` stops at the
container's root and no symlink is followed, not even the last component.
Where openat2 is missing (Linux < 5.6) each component is opened from its
parent's descriptor with O_NOFOLLOW.

A file that is read, written or locked is opened O_PATH first, its type
checked with fstat, and only a regular file is then opened for I/O, through
/proc/self/fd/N (the inode already held, nothing resolved again). Opening a
device is not free of effects (a watchdog is armed by open, a tape rewinds),
and a FIFO's open blocks: so neither is ever opened, only refused. Reads are
bounded.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterator

from smr.contract.errors import PermanentError

SYS_OPENAT2 = 437  # x86_64 and aarch64 alike
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_IN_ROOT = 0x10
CONFINED = RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
SMALL = 64 << 10  # a status or decision file is a line


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_have_openat2: bool | None = None


class UnsafePath(PermanentError):
    """Something in a container that the agent refuses to follow or read
    (a symlink, a FIFO, a device, an oversized file): a tenant's attempt to
    point the agent at the host, reported as such."""

    code = "unsafe-path-in-container"


def _refused(path: str, why: str) -> UnsafePath:
    return UnsafePath(f"/{path.lstrip('/')} in the container is {why}; the node agent does "
                      "not follow or read it (the workload replaced a file smr writes there)",
                      hint="remove it; smr's files in the container's smr volume are smr's own")


# smr's paths cross directories only: a file, FIFO or device where one is
# (or where a directory is opened) is the workload's doing.
_NOT_DIR = "not a directory, or is reached through something that is not one"


def _openat2(dirfd: int, path: str, flags: int, mode: int) -> int:
    global _have_openat2
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, CONFINED)
    fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dirfd),
                       ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        if err == errno.ENOSYS:
            _have_openat2 = False
            return _walk(dirfd, path, flags, mode)
        _have_openat2 = True
        if err == errno.ELOOP:
            raise _refused(path, "a symlink, or is reached through one")
        if err == errno.ENOTDIR:
            raise _refused(path, _NOT_DIR)
        raise OSError(err, os.strerror(err), path)
    _have_openat2 = True
    return int(fd)


def _walk(dirfd: int, path: str, flags: int, mode: int) -> int:
    """The same without openat2: component by component, O_NOFOLLOW each."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _refused(path, "a path with '..'")
    cur = os.dup(dirfd)
    try:
        for p in parts[:-1]:
            try:
                nxt = os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                              dir_fd=cur)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refused(path, "reached through a symlink") from None
                raise
            os.close(cur)
            cur = nxt
        last = parts[-1] if parts else "."
        try:
            return os.open(last, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=cur)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _refused(path, "a symlink") from None
            if e.errno == errno.ENOTDIR:
                raise _refused(path, _NOT_DIR) from None
            raise
    finally:
        os.close(cur)


class Root:
    """A container's root directory, held open; paths are inside it."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name  # for messages

    @classmethod
    def of_pid(cls, pid: int) -> Root:
        return cls(os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC),
                   f"the container of pid {pid}")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Root:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self, path: str, flags: int, mode: int = 0) -> int:
        return _openat2(self.fd, path.lstrip("/") or ".", flags, mode)

    @contextlib.contextmanager
    def dir(self, path: str) -> Iterator[int]:
        """A directory's descriptor (for the *at calls on the names in it)."""
        fd = self.open(path, os.O_PATH | os.O_DIRECTORY)
        try:
            yield fd
        finally:
            os.close(fd)

    def file(self, path: str, flags: int, *, create: int | None = None,
             cap: int | None = None) -> int:
        """A regular file opened with ``flags`` (never O_CREAT: ``create`` is
        the mode of a new file made where there is none). Anything else
        there, or a file over ``cap`` bytes, is refused without being opened
        for I/O."""
        for _ in range(8):
            try:
                held = self.open(path, os.O_PATH)
            except FileNotFoundError:
                if create is None:
                    raise
                try:  # a new file of ours: O_EXCL, so nothing there is opened
                    return self.open(path, flags | os.O_CREAT | os.O_EXCL, create)
                except FileExistsError:
                    continue  # made meanwhile: checked like any other
            try:
                return reopen(held, path, flags, cap)
            finally:
                os.close(held)
        raise _refused(path, "made and removed again and again while opened")

    def read(self, path: str, cap: int = SMALL) -> bytes:
        """A regular file's content, at most ``cap`` bytes, never blocking."""
        fd = self.file(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY, cap=cap)
        try:
            return os.read(fd, cap)
        finally:
            os.close(fd)

    def write_new(self, path: str, data: bytes) -> None:
        """Create ``path`` afresh: a regular file left there (an earlier run's)
        is replaced; anything else there is refused, not followed."""
        parent, name = _split(path)
        with self.dir(parent) as d:
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                pass
            else:
                if not stat.S_ISREG(st.st_mode):
                    raise _refused(path, _kind(st.st_mode))
                _unlink(d, name, path)
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644, dir_fd=d)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    def replace(self, path: str, data: bytes) -> None:
        """Write ``path`` atomically: a new file renamed over it."""
        parent, name = _split(path)
        with self.dir(parent) as d:
            tmp = f".{name}.smr-tmp"
            _unlink(d, tmp, f"{parent}/{tmp}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o644, dir_fd=d)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            try:
                os.rename(tmp, name, src_dir_fd=d, dst_dir_fd=d)
            except OSError as e:
                _unlink(d, tmp, f"{parent}/{tmp}")
                # A directory there (empty or not) is never removed: the
                # workload's, refused like any other kind it put there.
                if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise _refused(path, "a directory") from None
                raise

    def touch(self, path: str) -> None:
        """Set a regular file's times to now, in place (never recreated).
        Opened O_PATH: a FIFO or a device there is never really opened."""
        fd = self.open(path, os.O_PATH)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _refused(path, _kind(st.st_mode))
            os.utime(f"/proc/self/fd/{fd}")  # the file this fd holds, nothing resolved
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        parent, name = _split(path)
        with contextlib.suppress(FileNotFoundError), self.dir(parent) as d:
            _unlink(d, name, path)


def reopen(held: int, path: str, flags: int, cap: int | None = None) -> int:
    """The regular file that the O_PATH descriptor ``held`` holds, opened for
    I/O with ``flags``; anything else is refused, never opened."""
    st = os.fstat(held)
    if not stat.S_ISREG(st.st_mode):
        raise _refused(path, _kind(st.st_mode))
    # smr's files have one name each (written whole and renamed, or made
    # O_EXCL): a second is a hard link to a file the workload did not make.
    if st.st_nlink > 1:
        raise _refused(path, f"a hard link (a file of {st.st_nlink} names)")
    if cap is not None and st.st_size > cap:
        raise _refused(path, f"{st.st_size} bytes, more than the {cap} expected")
    return _through_proc(held, flags)


def _through_proc(held: int, flags: int) -> int:
    # The magic link to the inode ``held`` already pins: O_NOFOLLOW would
    # refuse the link itself, O_CREAT has nothing left to make.
    flags &= ~(os.O_NOFOLLOW | os.O_CREAT | os.O_EXCL)
    return os.open(f"/proc/self/fd/{held}", flags | os.O_NOCTTY | os.O_CLOEXEC)


def open_regular_at(dirfd: int, name: str, flags: int) -> int:
    """``name`` in the directory ``dirfd``, not followed, opened for I/O only
    if it is a regular file: the capture of a writable layer, where a file
    swapped for a device node or a FIFO meanwhile is not the layer's file
    any more (OSError, like a file removed meanwhile), and is never opened."""
    held = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        if not stat.S_ISREG(os.fstat(held).st_mode):
            raise OSError(errno.EINVAL, "not a regular file any more", name)
        return _through_proc(held, flags)
    finally:
        os.close(held)


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return f"not a regular file (mode {stat.filemode(mode)})"


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.strip("/").rpartition("/")
    if name in ("", ".", ".."):
        raise ValueError(f"not a file name: {path!r}")
    return parent, name


def _unlink(dirfd: int, name: str, path: str) -> None:
    """Remove a file or link (never followed); a directory there is the
    workload's and refused, never removed."""
    try:
        os.unlink(name, dir_fd=dirfd)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno in (errno.EISDIR, errno.EPERM):
            raise _refused(path, "a directory") from None
        raise


def has_openat2() -> bool | None:
    """Whether the last confined open used openat2 (None: none yet)."""
    return _have_openat2
