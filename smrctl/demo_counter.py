"""A stateful sample workload: a counter and a block of memory that changes
every step. Each line it prints carries the step and the digest of its whole
memory, which ``expected_digest`` recomputes independently: a restored process
that continues with the right step and digest has its state intact.

    python -m smrctl.demo_counter --mib 256 [--interval 0.2]
        [--state-file PATH] [--child] [--digest-every SECONDS]

``--digest-every``: digest the memory at most that often (and at the first
step, and at the first step after a restore) instead of at every step: the
lines between carry none. Reading the whole memory takes more CPU than the
rest of the step by far; the test suite runs dozens of counters at once.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import subprocess
import sys
import time
import zlib

SEED = 20261121


def mutate(buf: bytearray, step: int) -> None:
    i = (step * 7919 * 4099) % len(buf)
    buf[i] ^= 0xFF


def initial(mib: int) -> bytearray:
    rng = random.Random(SEED)
    buf = bytearray(mib << 20)
    for i in range(mib):  # randbytes() of more than 256 MiB at once overflows
        buf[i << 20 : (i + 1) << 20] = rng.randbytes(1 << 20)
    return buf


def digest(buf: bytearray) -> str:
    # CRC-32 reads the whole memory each step at a quarter of blake2b's CPU:
    # it catches a page lost or misplaced by a restore as surely, and the
    # test suite runs dozens of these counters at once on two cores.
    return f"{zlib.crc32(buf):08x}"


def expected_digest(mib: int, step: int) -> str:
    buf = initial(mib)
    for s in range(1, step + 1):
        mutate(buf, s)
    return digest(buf)


def started() -> tuple[str, int]:
    """Which process this is to the kernel, new at each restore, which
    nothing restored in memory can tell: its PID in the /proc it sees, and
    when it started (clock ticks since boot, /proc/self/stat).

    Where that /proc is not its PID namespace's (a local job's own namespace
    under the host's /proc) the PID alone tells (a restore brings a new one
    there), and stat is not opened: a file of /proc/<host PID> open at the
    freeze names a PID the restored process does not have, and CRIU cannot
    restore it."""
    pid = os.readlink("/proc/self")
    if pid != str(os.getpid()):
        return pid, 0
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    return pid, int(stat.rsplit(b")", 1)[1].split()[19])


def resumed_digest(after: list[dict[str, str]]) -> dict[str, str] | None:
    """The line that shows a restored counter's memory: its first line after
    the restore, or the second where the freeze fell between the first's
    restore check and its print (that line was decided before the dump)."""
    return next((ln for ln in after[:2] if "digest" in ln), None)


def parse_line(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--state-file")
    ap.add_argument("--child", action="store_true", help="also run a child process")
    ap.add_argument("--digest-every", type=float, default=0.0,
                    help="seconds between digests (0: every step)")
    a = ap.parse_args()
    child = None
    if a.child:
        # A child that counts too: the checkpoint must carry the whole tree.
        child = subprocess.Popen([sys.executable, "-c",
                                  "import time\nwhile True: time.sleep(0.1)"])
    state = open(a.state_file, "r+b" if os.path.exists(a.state_file) else "w+b") \
        if a.state_file else None
    buf = initial(a.mib)
    step = 0
    digested_at, start = -math.inf, started()
    while True:
        step += 1
        mutate(buf, step)
        now, restored = time.monotonic(), started()
        # Both ways round: restored on another host, the clock may be behind.
        due = not 0 <= now - digested_at < a.digest_every or restored != start
        if due:
            digested_at, start = now, restored
        if state:
            # Overwritten in place: the file's size stays what CRIU recorded.
            state.seek(0)
            state.write(f"{step:012d}\n".encode())
            state.flush()
        extra = f" child={child.pid}" if child else ""
        memory = f" digest={digest(buf)}" if due else ""
        print(f"step={step} pid={os.getpid()} mib={a.mib}{memory}{extra}", flush=True)
        time.sleep(a.interval)


if __name__ == "__main__":
    main()
