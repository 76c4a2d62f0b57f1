"""A Python multiprocessing pool, for the program tests: a
ProcessPoolExecutor of 4 workers and a multiprocessing.shared_memory block.

    python3 pool.py TASKS BLOCK_MIB

The parent fills the block with a known pattern, then submits TASKS tasks;
each worker attaches to the block by name, checks its slice, and takes about
a second (in small sleeps: a checkpoint lands in the middle of the work).
Lines printed: `ready NAME`, `done I DIGEST` per task, then `block ok|BAD`
and `finished N`. A test checks every task's digest against ``expected``.
"""

from __future__ import annotations

import hashlib
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import shared_memory

WORKERS = 4


def pattern(i: int, size: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (size // 32)


def expected(i: int, tasks: int, mib: int) -> str:
    part = (mib << 20) // tasks
    return hashlib.sha256(pattern(0, mib << 20)[i * part:(i + 1) * part]).hexdigest()


def work(name: str, i: int, tasks: int) -> tuple[int, str]:
    shm = shared_memory.SharedMemory(name)
    try:
        part = shm.size // tasks
        for _ in range(20):  # about a second, in steps
            time.sleep(0.05)
        return i, hashlib.sha256(bytes(shm.buf[i * part:(i + 1) * part])).hexdigest()
    finally:
        shm.close()


def main() -> None:
    tasks, mib = int(sys.argv[1]), int(sys.argv[2])
    shm = shared_memory.SharedMemory(create=True, size=mib << 20)
    shm.buf[:] = pattern(0, mib << 20)
    want = hashlib.sha256(bytes(shm.buf)).hexdigest()
    print(f"ready {shm.name}", flush=True)
    n = 0
    with ProcessPoolExecutor(WORKERS) as pool:
        for f in as_completed([pool.submit(work, shm.name, i, tasks) for i in range(tasks)]):
            i, digest = f.result()
            print(f"done {i} {digest}", flush=True)
            n += 1
    ok = hashlib.sha256(bytes(shm.buf)).hexdigest() == want
    print(f"block {'ok' if ok else 'BAD'}", flush=True)
    print(f"finished {n}", flush=True)
    shm.close()
    shm.unlink()


if __name__ == "__main__":
    main()
