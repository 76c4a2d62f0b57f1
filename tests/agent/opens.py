"""Which files this process opened for I/O, through fanotify: the in-process
node agents' opens of a tenant's files, told apart from any other agent's
that scans the same host (an O_PATH descriptor opens nothing and is not
reported)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct


class Opens:
    """Opens of files for I/O by this process (the in-process agents), seen
    by fanotify: other agents may scan the host's containers too (an
    O_PATH descriptor, which opens nothing, is not an open here)."""

    FAN_CLOEXEC, FAN_NONBLOCK, FAN_REPORT_FID = 0x1, 0x2, 0x200
    FAN_MARK_ADD, FAN_MARK_DONT_FOLLOW, FAN_OPEN = 0x1, 0x4, 0x20

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64,
                                            ctypes.c_int, ctypes.c_char_p]
        self.groups: dict[str, int] = {}

    def watch(self, path: str) -> None:
        fd = self.libc.fanotify_init(self.FAN_CLOEXEC | self.FAN_NONBLOCK
                                     | self.FAN_REPORT_FID, os.O_RDONLY)
        assert fd >= 0, f"fanotify: {os.strerror(ctypes.get_errno())}"
        self.groups[path] = fd
        ok = self.libc.fanotify_mark(fd, self.FAN_MARK_ADD | self.FAN_MARK_DONT_FOLLOW,
                                     self.FAN_OPEN, -100, os.fsencode(path))  # AT_FDCWD
        assert ok == 0, f"{path}: {os.strerror(ctypes.get_errno())}"

    def opened(self) -> list[str]:
        out = []
        for path, fd in self.groups.items():
            with contextlib.suppress(BlockingIOError):
                buf = os.read(fd, 1 << 16)
                while buf:
                    # struct fanotify_event_metadata
                    size, _, _, _, mask, _, pid = struct.unpack_from("IBBHQii", buf)
                    if mask & self.FAN_OPEN and pid == os.getpid():
                        out.append(path)
                    buf = buf[size:]
        return out

    def close(self) -> None:
        for fd in self.groups.values():
            os.close(fd)
