"""A child subreaper (as `smr up` is) adopts process A, whose child B ends
while A's main thread has ended and another thread of A still runs (a CUDA
process dying: its driver threads end last). B is then A's zombie, not ours;
once A's last thread ends, B comes to us. Prints B's state at the end
(tests/test_reaping.py): '' when B was reaped.

    python -m tests.helpers.reap_scenario
"""

from __future__ import annotations

import subprocess
import sys
import time

from smr.process import reaper

A = """
import ctypes, subprocess, sys, threading, time
b = subprocess.Popen(["sleep", "0.5"])
threading.Thread(target=time.sleep, args=(1.5,)).start()
print(b.pid, flush=True)
time.sleep(0.2)
ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: the main thread alone ends
"""


def main() -> None:
    assert reaper.become_subreaper()
    a = subprocess.Popen([sys.executable, "-c", A], stdout=subprocess.PIPE, text=True)
    b = int(a.stdout.readline())  # type: ignore[union-attr]
    reaper.adopt(a.pid)
    assert b in reaper._adopted, "B was not adopted with A's tree"
    # B ends at 0.5 s, A's last thread at 1.5 s: a loaded machine may run
    # them late, so reap until B is gone, for 20 s at most.
    deadline = time.monotonic() + 20
    while reaper._state(b) is not None and time.monotonic() < deadline:
        reaper.reap()
        time.sleep(0.05)
    print(f"B {reaper._state(b) or ''}", flush=True)


if __name__ == "__main__":
    main()
