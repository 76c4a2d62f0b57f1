"""Servers a test session starts end with the process that started them.

Under pytest-xdist each worker starts its own nats-server, moto and
containerd for the session; a worker killed (a crash, a timeout, Ctrl-C at
the wrong moment) runs no fixture teardown, and its servers would run on,
holding ports, memory and mounts, for every later run on the machine. With
the kernel's parent-death signal they get SIGTERM as soon as the thread that
started them ends: start them from the worker's main thread (session
fixtures do)."""

from __future__ import annotations

import ctypes
import signal
import subprocess

PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent() -> None:
    """A ``preexec_fn``: SIGTERM to the child when its parent thread ends."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def interrupt(proc: subprocess.Popen[bytes], grace: float = 60) -> None:
    """End ``proc`` as a user's Ctrl-C does (SIGINT, continued first if it was
    stopped), and kill it if it has not exited within ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
