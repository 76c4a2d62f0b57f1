"""How fast one node's checkpointer worker starts the requests it fetched
ahead (smr/bus/ahead.py), through the path the node agent runs: an
admission that asks each request's size estimate, ``ahead`` 256, four at
once. The requests are queued first, then the worker starts: the time from
its start until it has started every one. The step does nothing, so the
numbers are the worker's loop, NATS's round trips and the step state's
writes, not a dump.

Real: nats-server, smr's Bus and Worker. STAND-INS: the step (returns at
once) and the estimate (0 bytes, after one pass of the event loop).

``--base REV``: the same measurement with the smr package of commit REV
(checked out in a temporary git worktree), round by round in turns with
this tree's, so the two share the machine's drift. Each round is a process
of its own, on a fresh nats-server.

    .venv/bin/python bench/ahead_dispatch.py [--requests 2000] [--rounds 3] [--base REV]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import smr
from services.checkpointer.admission import CheckpointAdmission
from smr import config
from smr.bus.client import Bus
from smr.bus.liveness import StepLocks
from smr.bus.topology import BusConfig
from smr.bus.worker import Worker
from smr.contract.messages import CkptDone, CkptRequested, Target
from smr.natsserver import NatsServer

REPO = Path(__file__).resolve().parent.parent


async def measure(n: int, finals_every: int) -> dict[str, Any]:
    """One round, with the smr package the interpreter found first (PYTHONPATH)."""
    class Nothing:
        kind = "ckpt.requested"

        def __init__(self) -> None:
            self.started = 0
            self.all_started = asyncio.Event()

        async def run(self, req: CkptRequested, progress: Any) -> CkptDone:
            self.started += 1
            if self.started == n:
                self.all_started.set()
            return CkptDone.for_request(req, status="succeeded", generation=1)

        async def recover(self, req: CkptRequested, state: dict[str, Any]) -> None:
            return None

    async def estimate(req: CkptRequested) -> int:
        await asyncio.sleep(0)
        return 0

    s = config.load({k: v for k, v in os.environ.items() if k == "SMR_NATS_SERVER"})
    with tempfile.TemporaryDirectory() as d:
        srv = NatsServer(s.nats_server_binary(), Path(d) / "nats", die_with_parent=True)
        srv.start()
        bus = await Bus.connect(srv.url, name="bench", config=BusConfig())
        try:
            node = f"bench-{uuid.uuid4().hex[:8]}"
            # The backlog first (a wave's requests, queued on a busy node),
            # then the worker: the time is its own, not the publisher's.
            await bus.ensure_consumer("ckpt.requested", node, 4 + 256)
            t0 = time.monotonic()
            for i in range(n):
                await bus.publish(CkptRequested(
                    request_id=f"r-{i}", checkpoint_id=f"ck-{i % 50}", node=node,
                    target=Target.job(f"j-{i % 50}"), reason="heartbeat",
                    leave_running=bool(i % finals_every)))
            published = time.monotonic() - t0
            step = Nothing()
            w = Worker(bus, step, node, service="bench", locks=StepLocks(Path(d) / "locks"),
                       concurrency=4, ahead=256,
                       admission=CheckpointAdmission(Path(d), estimate))
            t0 = time.monotonic()
            task = asyncio.create_task(w.run())
            await asyncio.wait_for(step.all_started.wait(), 600)
            started = time.monotonic() - t0
            w.stop()
            await asyncio.wait_for(task, 60)
        finally:
            await bus.close()
            srv.stop()
    return {"smr": str(Path(smr.__file__).parent.parent), "published_s": published,
            "started_s": started, "per_s": n / started}


def round_in(tree: Path, a: argparse.Namespace) -> dict[str, Any]:
    # One nats-server binary for both (a worktree has no .tools of its own).
    nats = config.load({k: v for k, v in os.environ.items() if k == "SMR_NATS_SERVER"})
    env = {**os.environ, "PYTHONPATH": str(tree), "SMR_NATS_SERVER": nats.nats_server_binary()}
    out = subprocess.run([sys.executable, __file__, "--child", "--requests", str(a.requests),
                          "--finals-every", str(a.finals_every)],
                         cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the round in {tree} failed:\n{out.stderr[-3000:]}")
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(got["smr"]).resolve() == tree.resolve(), f"measured {got['smr']}, not {tree}"
    return got


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--finals-every", type=int, default=10,
                    help="one request in this many is a final one")
    ap.add_argument("--base", default="", help="a commit measured in turns with this tree")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(asyncio.run(measure(a.requests, a.finals_every))))
        return
    head = git("rev-parse", "--short", "HEAD") + ("+" if git(
        "status", "--porcelain", "--untracked-files=no") else "")
    with tempfile.TemporaryDirectory() as d:
        trees = [(head, REPO)]
        if a.base:
            base = Path(d) / "base"
            git("worktree", "add", "-q", "--detach", str(base), a.base)
            trees.insert(0, (a.base[:7], base))
        try:
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
            for r in range(a.rounds):
                for name, tree in trees:
                    got = round_in(tree, a)
                    runs[name].append(got)
                    print(f"# round {r + 1} {name}: {got['per_s']:.0f} requests/s started "
                          f"({got['started_s']:.2f} s)", flush=True)
        finally:
            if a.base:
                git("worktree", "remove", "--force", str(base))
    print(f"{a.requests} ckpt.requested on one node (one in {a.finals_every} final), "
          f"concurrency 4, ahead 256, a no-op step; median of {a.rounds} rounds")
    print(f"{'':12}{'started/s':>12}{'all started s':>15}{'published s':>13}")
    for name, rs in runs.items():
        print(f"{name:12}{statistics.median(x['per_s'] for x in rs):>12.0f}"
              f"{statistics.median(x['started_s'] for x in rs):>15.2f}"
              f"{statistics.median(x['published_s'] for x in rs):>13.2f}")


if __name__ == "__main__":
    main()
