"""Who a restored process is: its PID, start ticks and boot id.

A PID alone names whatever holds it now: once the restored process has
exited, or the host rebooted, the kernel hands the number to anything. A
restore writes this identity beside CRIU's pidfile the moment CRIU returns;
a recovery adopts the process only if all three still match, so a stranger
that took the PID is never recorded as the job (then frozen, dumped and
killed by the job's next checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from smr.jobs import proc_start_ticks

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """This boot's id: it changes on every boot, so it tells a file written
    before a reboot from one written since."""
    return BOOT_ID.read_text().strip()


def booted_at() -> float:
    """When this boot began (epoch seconds, /proc/stat btime: whole seconds,
    so up to a second early)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return time.time()  # never: every Linux has it; then nothing dates from this boot


def write_durably(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one step (a rename), on disk when
    this returns: a reader after a crash finds the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_ticks: int
    boot_id: str

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """``pid`` as it is now; None where no such live process."""
        ticks = proc_start_ticks(pid)
        return None if ticks is None else cls(pid, ticks, boot_id())

    def matches(self) -> bool:
        """Is this very process still running: same boot, and its PID held
        by a process that started at the same tick?"""
        return self.boot_id == boot_id() and proc_start_ticks(self.pid) == self.start_ticks

    def write(self, path: Path) -> None:
        """Written whole or not at all (a rename), and on disk before this
        returns: a recovery reads either the identity or nothing."""
        write_durably(path, orjson.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> ProcessIdentity | None:
        """The identity written at ``path``; None where there is none (or
        it is not one: never written whole, so never trusted)."""
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            raw = orjson.loads(path.read_bytes())
            ident = cls(int(raw["pid"]), int(raw["start_ticks"]), str(raw["boot_id"]))
            if ident.pid > 0:
                return ident
        return None

    @classmethod
    def started_between(cls, pid: int, begun: Path, written: Path) -> ProcessIdentity | None:
        """``pid``'s identity if that process started after ``begun`` and
        before ``written`` were written, in this boot; else None. A restore
        writes ``begun`` as it starts CRIU, and CRIU writes its pidfile
        (``written``) once the tree it restored runs: the process it names
        started in between. One that held the PID before, or took it once
        that process ended, started outside. (Start ticks are dated from the
        boot's start, known to the second: only a process started within a
        second of either file could pass for the restored one.)"""
        ident = cls.of(pid)
        try:
            after, before = begun.stat().st_mtime, written.stat().st_mtime
        except OSError:
            return None
        boot = booted_at()
        if ident is None or after < boot:
            return None
        # ``boot`` is up to a second early, so ``started`` is too.
        started = boot + ident.start_ticks / os.sysconf("SC_CLK_TCK")
        return ident if after - 1.0 < started <= before else None

    @classmethod
    def read_match(cls, path: Path) -> ProcessIdentity | None:
        """The identity at ``path`` if that process still runs; else None."""
        ident = cls.read(path)
        return ident if ident is not None and ident.matches() else None


def record(pid: int, path: Path) -> ProcessIdentity | None:
    """Write ``pid``'s identity at ``path``; None (nothing written) where it
    no longer runs."""
    ident = ProcessIdentity.of(pid)
    if ident is not None:
        ident.write(path)
    return ident
