"""Run one thread of a stopped process while every other thread stays stopped.

The CUDA driver restores a process's GPU state through one of the process's
own threads (the one ``cuCheckpointProcessGetRestoreThreadId`` names). Until
it has, the process's memory lacks the driver's mappings, and any other
thread that touches one dies: a jitted JAX loop was killed by SIGSEGV in
libcuda.so the moment CRIU resumed it (H100, driver 580). So a
restored GPU process is left stopped by CRIU (``--leave-stopped``), and
``with_only(pid, tid, work)``:

1. ptrace-seizes every thread of ``pid`` and interrupts it;
2. lets ``tid`` alone run, every signal but SIGTRAP blocked, while ``work()``
   (the driver's restore and unlock) runs: a tracer's PTRACE_CONT runs a
   thread even while its process is in a group stop;
3. stops ``tid`` again, gives it back its signal mask, and detaches from
   every thread; the caller's SIGCONT then lets every thread go on from
   where CRIU left it.

(A SIGCONT while the threads are seized would not do: each seized thread
is then due a ptrace notification, and ``tid`` stopped again at once.)

CRIU's own CUDA plugin does the same from inside CRIU (its
``resume_device``). Every ptrace call must come from the one thread that
seized: the caller runs this in a worker thread of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from smr.contract.errors import PermanentError

log = logging.getLogger("smr.gpu.frozen")

T = TypeVar("T")

PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_GETSIGMASK = 0x420A
PTRACE_SETSIGMASK = 0x420B
__WALL = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]


class FrozenError(PermanentError):
    code = "cuda-checkpoint-failed"


def _ptrace(req: int, tid: int, addr: int | None = None, data: object = None) -> None:
    if _libc.ptrace(req, tid, addr, data) == -1:
        err = ctypes.get_errno()
        raise FrozenError(f"ptrace({req:#x}) of thread {tid} failed: {os.strerror(err)}")


def threads(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []


def state(tid: int) -> str:
    """The thread's state letter (t: ptrace stop, T: stopped), '' if gone."""
    try:
        stat = Path(f"/proc/{tid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2]


def stopping(pid: int) -> bool:
    """Is ``pid`` stopped, or about to stop? CRIU leaves a tree stopped
    (``--leave-stopped``) by sending each task SIGSTOP and detaching; the
    task acts on it only once it runs again, so right after CRIU exits it
    may still show R or S with the SIGSTOP pending. Judged by the state
    alone, such a tree was taken for a running one, never continued, and
    stopped a moment later for good (the fault campaign saw it).
    Any thread counts: a leader that ended (pthread_exit) stays Z while
    its other threads stop."""
    if any(state(t) == "T" for t in threads(pid) or [pid]):
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    stop = 1 << (signal.SIGSTOP - 1)
    for line in status.splitlines():
        if line.startswith(("ShdPnd:", "SigPnd:")) and int(line.split()[1], 16) & stop:
            return True
    return False


def held(pids: list[int], timeout: float = 2.0) -> bool:
    """Is the tree of ``pids`` held stopped, as CRIU's --leave-stopped left
    it: every thread that can stop in its group stop (T), one at least? A
    zombie never stops: a child that had ended, not yet reaped, when CRIU
    froze the tree is saved as one and stays one while its parent is held (a
    shell's ``$(cat ...)``; such a tree was taken for a running one). A
    thread whose SIGSTOP is still pending is waited for, up to ``timeout``."""
    deadline = time.monotonic() + timeout
    found = False
    for pid in pids:
        for t in threads(pid) or [pid]:
            while (s := state(t)) not in ("T", "Z", "X", ""):
                if not stopping(pid) or time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
            found = found or s == "T"
    return found


def wait_stopped(pids: list[int], timeout: float = 10.0) -> None:
    """Until every thread of each of ``pids`` is in its group stop (T)."""
    for pid in pids:
        for t in threads(pid):
            if state(t) not in ("", "Z", "X"):  # ended, or a zombie leader: never stops
                _until(t, "T", timeout)


def _until(tid: int, letters: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (s := state(tid)) not in letters:
        if not s:
            raise FrozenError(f"thread {tid} ended while held for the GPU restore")
        if time.monotonic() > deadline:
            raise FrozenError(f"thread {tid} did not stop within {timeout:g}s (state {s})")
        time.sleep(0.001)


def _cont(tid: int) -> None:
    """Run ``tid`` on; a trap it still owed (a notification) is taken and it
    is continued again, until it stays running."""
    _ptrace(PTRACE_CONT, tid, 0, 0)
    for _ in range(50):
        time.sleep(0.005)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(tid, os.WNOHANG | __WALL)  # its report, if any: not needed
        if state(tid) != "t":
            return
        _ptrace(PTRACE_CONT, tid, 0, 0)
    raise FrozenError(f"thread {tid} stops again each time it is continued")


def _born(tid: int) -> str:
    """The thread's start time (ticks since boot): a reused tid differs."""
    try:
        stat = Path(f"/proc/{tid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2:].split()[19]


def _own_mask(tid: int, current: int, keep: Path | None) -> int:
    """The thread's own signal mask: ``current``, unless a holder that died
    mid-hold left it in ``keep`` (``current`` is then that holder's blocked
    mask, which the thread would otherwise keep for good). Kept there until
    the hold ends, so that the next agent gives the right one back."""
    if keep is None:
        return current
    born = _born(tid)
    with contextlib.suppress(OSError, ValueError):
        saved_born, saved = keep.read_text().split()
        if saved_born == born:
            return int(saved, 16)
    tmp = keep.with_name(keep.name + ".tmp")
    try:
        keep.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(f"{born} {current:x}\n")
        os.replace(tmp, keep)
    except OSError as e:
        # A full disk must not keep the thread from being given back its
        # own mask now (it is in memory): only a holder dying mid-hold would
        # then leave the blocked one. Failing here left a GPU tree stopped.
        log.warning("cannot keep thread %d's signal mask in %s (%s): kept in memory only",
                    tid, keep, e.strerror)
        tmp.unlink(missing_ok=True)
    return current


def with_only(pid: int, tid: int, work: Callable[[], T], keep: Path | None = None) -> T:
    """``work()`` while thread ``tid`` of the stopped process ``pid`` alone
    runs; then SIGCONT lets every thread go on. ``keep``: a file (in a
    directory that outlives this process) where the thread's own signal mask
    is kept while it runs with all but SIGTRAP blocked."""
    seized: list[int] = []
    mask = ctypes.c_uint64(0)
    try:
        for _ in range(2):  # a thread CRIU is still creating shows up the second time
            for t in threads(pid):
                # A zombie leader (its main thread ended) never runs, and
                # cannot be seized (EPERM): only the threads that live.
                if t not in seized and state(t) not in ("", "Z", "X"):
                    # A stopped thread is held in a ptrace stop once seized;
                    # a pending interrupt would stop it again after its CONT.
                    _ptrace(PTRACE_SEIZE, t, 0, 0)
                    seized.append(t)
                    if state(t) != "t":
                        _ptrace(PTRACE_INTERRUPT, t, 0, 0)
        for t in seized:
            _until(t, "t")
        if tid not in seized:
            raise FrozenError(f"thread {tid} is not a thread of process {pid}")
        _ptrace(PTRACE_GETSIGMASK, tid, ctypes.sizeof(mask), ctypes.byref(mask))
        mask.value = _own_mask(tid, mask.value, keep)
        only_trap = ctypes.c_uint64(~(1 << (signal.SIGTRAP - 1)) & (2**64 - 1))
        _ptrace(PTRACE_SETSIGMASK, tid, ctypes.sizeof(only_trap), ctypes.byref(only_trap))
        _cont(tid)
        try:
            return work()
        finally:
            _ptrace(PTRACE_INTERRUPT, tid, 0, 0)
            _until(tid, "t")
            _ptrace(PTRACE_SETSIGMASK, tid, ctypes.sizeof(mask), ctypes.byref(mask))
            if keep is not None:
                keep.unlink(missing_ok=True)
    finally:
        for t in seized:
            with contextlib.suppress(FrozenError):
                _ptrace(PTRACE_DETACH, t, 0, 0)
