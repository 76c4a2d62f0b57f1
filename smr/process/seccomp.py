"""A seccomp filter under which ``io_uring_setup`` fails with ENOSYS.

CRIU cannot save an io_uring, and libuv 1.50 and later makes one in every
event loop (torchrun's rendezvous store), falling back to epoll only when
the call fails. The filter is inherited by every child and saved and
restored by CRIU, so installed before a job's exec it covers the job's
whole tree for good. smr-init does the same for pods and `smr exec` jobs
in their own PID namespace (services/agent/init/smr-init.c); this is for
the jobs ``smr.process.reaper`` starts (GPU jobs). ``SMR_IO_URING=allow`` in the
job's environment keeps io_uring (its checkpoint is then refused).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

IO_URING_SETUP = 425  # on every architecture; x32's has bit 30 set
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def deny_io_uring(env: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Install the filter on this process (and so on what it execs); None
    when done or opted out, else why not."""
    if env.get("SMR_IO_URING") == "allow":
        return None
    code = b"".join([
        _insn(_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        _insn(_JEQ_K, 2, 0, IO_URING_SETUP),
        _insn(_JEQ_K, 1, 0, 0x40000000 | IO_URING_SETUP),
        _insn(_RET_K, 0, 0, SECCOMP_RET_ALLOW),
        _insn(_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS),
    ])
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _Prog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                      ctypes.c_ulong]
    if prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0:
        return None
    # Without CAP_SYS_ADMIN the kernel takes a filter only with no_new_privs.
    if ctypes.get_errno() == errno.EACCES and prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) == 0 \
            and prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) == 0:
        return None
    return os.strerror(ctypes.get_errno())
