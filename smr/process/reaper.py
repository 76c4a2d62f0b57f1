"""Reaping local jobs, so that their restore never waits on the host's PID 1.

A job that runs in the host's PID namespace (every GPU job: `smr exec --gpu`)
is restored with its very PIDs, so they must be free: its dumped processes
reaped. An orphan's zombie waits for PID 1, and a PID 1 that is not a prompt
reaper (a plain program in a container or VM) keeps the PID taken: the
restore failed with CRIU's ``Can't fork for N: File exists``. So nothing of
a job is left to PID 1:

- `smr exec` starts a job under ``python -m smr.process.reaper -- CMD``: a child
  subreaper that waits for the job and every orphan of its tree, and ends
  when they have.
- `smr up` (the embedded node) is a child subreaper too: a tree CRIU restores
  is reparented to it when CRIU exits. It reaps the processes of those trees
  (``adopt``), and keeps how each ended, for the report of a restored process
  that died (``how_ended``).

Only adopted PIDs are waited for: a blanket ``waitpid(-1)`` would take the
exit status of CRIU runs from asyncio, which waits for those itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from pathlib import Path

from smr.process.seccomp import deny_io_uring
from smr.process.tree import process_tree

PR_SET_CHILD_SUBREAPER = 36

_adopted: set[int] = set()
_ended: dict[int, int] = {}  # pid -> wait status, for the latest process of each pid


def become_subreaper() -> bool:
    """Orphans of this process's descendants come to it instead of PID 1."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def adopt(root: int) -> None:
    """Reap ``root`` and its descendants when they end as our children."""
    _ended.pop(root, None)
    _adopted.update(process_tree(root))


def reap() -> None:
    """Wait for every adopted process that has ended (never blocks). The tree
    of a live adopted process is adopted too: its orphans come here."""
    for pid in list(_adopted):
        if _alive(pid):
            _adopted.update(process_tree(pid))
    for pid in list(_adopted):
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not (or no longer) ours: its parent reaps it
            # Unless it is a zombie whose parent is still ending: a child
            # that ended before its killed parent's last thread (a CUDA
            # process's driver threads end last) comes here only then.
            if _state(pid) is None:
                _adopted.discard(pid)
            continue
        if got and (os.WIFEXITED(status) or os.WIFSIGNALED(status)):  # not a ptrace stop
            _ended[pid] = status
            _adopted.discard(pid)
    while len(_ended) > 4096:  # a long-lived node: keep the recent ones
        _ended.pop(next(iter(_ended)))


def how_ended(pid: int) -> str | None:
    """'exited with status N' or 'killed by SIGNAME' for a process reaped
    here; what /proc says otherwise; None while it runs."""
    reap()
    if pid in _ended:
        return describe(_ended[pid])
    state = _state(pid)
    if state is None:
        return "ended (its exit status went to another parent)"
    if state == "Z":
        return f"ended, a zombie of PID {_ppid(pid)} that has not reaped it"
    return None


def describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"killed by {name}" + (" (core dumped)" if os.WCOREDUMP(status) else "")
    return f"exited with status {os.WEXITSTATUS(status)}"


def holder(pid: int) -> str | None:
    """Who holds ``pid`` now: None if it is free."""
    state = _state(pid)
    if state is None:
        return None
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        comm = "?"
    if state == "Z":
        return f"a zombie ({comm}) that its parent, PID {_ppid(pid)}, has not reaped"
    return f"a running process ({comm})"


def _stat(pid: int) -> list[str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def _state(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[0] if fields else None


def _ppid(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[1]) if fields else 0


def _alive(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def main(argv: list[str]) -> int:
    """``python -m smr.process.reaper -- CMD...``: run CMD as its own session's
    leader, reap it and every orphan of its tree, and end with its status."""
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m smr.process.reaper -- CMD [ARGS...]", file=sys.stderr)
        return 2
    become_subreaper()
    child = os.fork()
    if child == 0:
        try:
            os.setsid()
            if why := deny_io_uring():
                print(f"smr: io_uring stays on ({why}); a checkpoint of a process holding "
                      "one is refused", file=sys.stderr)
            os.execvp(argv[0], argv)
        except OSError as e:
            print(f"smr: cannot run {argv[0]}: {e}", file=sys.stderr)
        os._exit(127)
    # The job's signals are its own: this process only waits.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    code = 0
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return code
        except InterruptedError:
            continue
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(sys.argv[1:]))
