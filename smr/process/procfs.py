"""Another process's /proc files, read bounded.

A process's argument and environment areas are its own to size: execve takes
up to 6 MiB of them, and prctl(PR_SET_MM_MAP), which needs no privilege for
these fields, points them at any mapping of the process, gigabytes of it. smr
reads every process's command line several times a second (the node agent's
look for smr-init, a recovery's look for a CRIU still running), so every such
read here stops at a limit and costs time linear in what it reads. Plain os
calls, no pathlib: these reads are most of what an idle node agent costs
(bench/shim_scan.py).
"""

from __future__ import annotations

import os
import signal
import time

# A command line read to tell what a process is (smr-init, CRIU, nats-server):
# the commands smr looks for are far shorter.
ARGV_MAX = 64 << 10
# An environment read for one variable: above what execve takes, so a real
# one is never cut.
ENVIRON_MAX = 8 << 20


def read(pid: int, name: str, *, limit: int, upto: bytes = b"") -> bytes | None:
    """/proc/<pid>/<name>, read to its end, to ``limit`` bytes (a read may
    bring up to 64 KiB more), or until a read brings the byte ``upto``; None
    once the process is gone."""
    try:
        fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    chunks: list[bytes] = []
    size = 0
    try:
        while part := os.read(fd, 65536):
            chunks.append(part)
            size += len(part)
            if (upto and upto in part) or size >= limit:
                break
    except OSError:
        return None
    finally:
        os.close(fd)
    return b"".join(chunks)


def argv(pid: int) -> list[bytes] | None:
    """``pid``'s command line, its first ARGV_MAX bytes; None once it is gone."""
    raw = read(pid, "cmdline", limit=ARGV_MAX)
    return None if raw is None else raw[:ARGV_MAX].split(b"\0")


def argv0(pid: int) -> bytes | None:
    """``pid``'s argv[0]; None once it is gone, or when it is longer than
    ARGV_MAX (no command smr looks for has one so long)."""
    raw = read(pid, "cmdline", limit=ARGV_MAX, upto=b"\0")
    if raw is None or b"\0" not in raw[:ARGV_MAX]:
        return None
    return raw.split(b"\0", 1)[0]


def env_value(pid: int, key: str) -> str | None:
    """``key``'s value in ``pid``'s environment, its first ENVIRON_MAX bytes:
    the first one set, as getenv() finds it; None if unset or gone. Searched
    as bytes, never parsed whole."""
    raw = read(pid, "environ", limit=ENVIRON_MAX)
    if raw is None:
        return None
    raw = raw[:ENVIRON_MAX]
    want = key.encode() + b"="
    if raw.startswith(want):
        start = len(want)
    else:
        at = raw.find(b"\0" + want)
        if at < 0:
            return None
        start = at + 1 + len(want)
    end = raw.find(b"\0", start)
    return raw[start:end if end >= 0 else len(raw)].decode(errors="replace")


def stat_fields(pid: int, name: str = "stat") -> list[bytes] | None:
    """``pid``'s stat fields after its command name (the first is its state,
    the twentieth its start tick); None once it is gone, or a zombie.
    ``name``: another stat file of it (a thread's: ``task/<tid>/stat``)."""
    raw = read(pid, name, limit=ARGV_MAX)
    if not raw or b")" not in raw:
        return None
    fields = raw[raw.rindex(b")") + 2:].split()
    return None if not fields or fields[0] in (b"Z", b"X") else fields


PF_EXITING = 0x4  # include/linux/sched.h: the task is on its way out
_KILL_PENDING = 1 << (signal.SIGKILL - 1)


def thread_runs(pid: int, tid: str) -> bool:
    """A thread neither ended, on its way out, nor with SIGKILL pending (a
    process killed: each thread gets it, and starts its exit when next run)."""
    fields = stat_fields(pid, f"task/{tid}/stat")
    # Fields 9 (flags) and 31 (the thread's own pending signals) of stat.
    if fields is None or len(fields) <= 28:
        return False
    return not (int(fields[6]) & PF_EXITING or int(fields[28]) & _KILL_PENDING)


LOOKS = 5  # three missed a process that execs in a loop once in 100,000 calls


def ended(pid: int) -> bool:
    """Has ``pid`` ended, or is it ending: no thread of it left running? A
    killed process's threads each exit when next run, the last one freeing
    its memory (a second for 3 GB), and until then /proc shows its first
    thread as a zombie or as running on. A process whose first thread exited
    (a zombie) while another runs has not ended.

    One listing can miss the thread that runs: one thread starts the next
    and ends while its threads are read, or the thread that execs takes the
    first one's PID. So LOOKS looks, a millisecond apart, must agree, and a
    thread that appeared between two looks means a live process (an ending
    one starts none)."""
    before: set[str] | None = None
    for look in range(LOOKS):
        if look:
            time.sleep(0.001)
        if thread_runs(pid, str(pid)):  # one read, for a process running as most are
            return False
        try:
            tids = set(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            return True  # gone
        if (before is not None and tids - before) or \
                any(thread_runs(pid, t) for t in tids if t != str(pid)):
            return False
        before = tids
    return True
