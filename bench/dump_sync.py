"""What fsyncing a finished dump costs (services/checkpointer/dumpstamp), side by side.

A counter job holding ``--mib`` of memory is dumped (leave running) by real
CRIU into a fresh directory, then committed to a local store from there,
``--rounds`` times in turns: without an fsync (the code before it), with
``sync_tree`` started ``--after`` seconds after the dump's end beside the
commit, as the checkpoint step runs it (dumpstamp.SYNC_AFTER_S), and with it
started at once. Reported: the dump, the commit (the step's path), and when
the fsync ended, from the commit's start (off that path).

    sudo .venv/bin/python bench/dump_sync.py [--mib 2048] [--rounds 3] [--after 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from statistics import median

from services.checkpointer.dumpstamp import SYNC_AFTER_S, sync_tree
from services.storage.local import LocalBackend
from services.storage.store import CheckpointStore
from smr import config
from smr.jobs import launch
from smr.process.criu import Criu


async def synced_after(work: Path, after: float) -> None:
    await asyncio.sleep(after)
    await asyncio.to_thread(sync_tree, work)


async def turn(criu: Criu, store: CheckpointStore, pid: int, root: Path,
               after: float | None) -> dict[str, float]:
    work = root / uuid.uuid4().hex
    t = time.monotonic()
    run = await criu.dump(pid, work / "images", leave_running=True)
    out = {"dump": run.seconds, "size_mib": sum(
        p.stat().st_size for p in (work / "images").iterdir()) / 2**20}
    t = time.monotonic()
    syncing = asyncio.create_task(synced_after(work, after)) if after is not None else None
    await store.commit("bench", "sync", work, {
        "request_id": uuid.uuid4().hex, "node": "bench", "reason": "api",
        "target": {"kind": "job", "job_id": "sync"}, "leave_running": True,
        "pre_dump": False, "versions": {}})
    out["commit"] = time.monotonic() - t
    if syncing:
        await syncing  # the step cancels it here; measured to its end
        out["fsync_end"] = time.monotonic() - t
    shutil.rmtree(work)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--after", type=float, default=SYNC_AFTER_S)
    ap.add_argument("--dir", default=None, help="where dumps are written (default: a temp dir)")
    a = ap.parse_args()
    s = config.load({})
    root = Path(tempfile.mkdtemp(prefix="dump-sync-", dir=a.dir))
    criu = Criu(s.criu_binary())
    store = CheckpointStore(LocalBackend(root / "store"))
    job = launch("sync", [sys.executable, "-m", "smrctl.demo_counter", "--mib", str(a.mib),
                          "--interval", "0.2"], log=root / "job.log", cwd=root, node="bench")
    await asyncio.sleep(2 + a.mib / 512)  # its memory written
    kinds = {"no fsync": None, f"fsync +{a.after:.0f}s": a.after, "fsync at once": 0.0}
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    try:
        for _ in range(a.rounds):
            for name, after in kinds.items():
                rows[name].append(await turn(criu, store, job.pid, root, after))
                # Each turn starts with the disk's dirty pages written back.
                await asyncio.to_thread(os.sync)
    finally:
        os.kill(job.pid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
    print(f"dump of a {a.mib} MiB counter, {a.rounds} rounds, medians (s):")
    for name, rs in rows.items():
        cols = {k: median(r[k] for r in rs) for k in rs[0]}
        print(f"  {name:13} " + "  ".join(f"{k} {v:.2f}" for k, v in cols.items()))


if __name__ == "__main__":
    asyncio.run(main())
