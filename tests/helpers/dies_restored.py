"""A process that ends as soon as it is restored (tests/test_reaping.py):
it counts, and when its start time in /proc changes (a CRIU restore makes a
new process) it prints why and ends, by ``exit:N`` or ``signal:NAME``.

    python -m tests.helpers.dies_restored exit:3 | signal:SIGSEGV
"""

from __future__ import annotations

import os
import signal
import sys
import time


def start_ticks() -> str:
    stat = open("/proc/self/stat").read()
    return stat[stat.rindex(")") + 2:].split()[19]


def main() -> None:
    how, _, what = sys.argv[1].partition(":")
    born = start_ticks()
    step = 0
    while True:
        if start_ticks() != born:
            print(f"restored, ending by {how} {what}", flush=True)
            if how == "signal":
                os.kill(os.getpid(), signal.Signals[what])
            os._exit(int(what))
        step += 1
        if step % 100 == 0:
            print(f"step={step // 100}", flush=True)
        time.sleep(0.001)


if __name__ == "__main__":
    main()
