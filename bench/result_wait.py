"""How long a requester waits to see a step's result once the step has it
(``Bus.request`` / ``wait_result``: the CLI, the agent's restores, the
watcher before it recreates a drained bare pod), and what many waiters cost
the NATS server, this tree side by side with another's in one run:

    .venv/bin/python bench/result_wait.py [--base DIR] [--n 30] [--waiters 200]

``--base DIR``: a checkout of the commit to compare with (``git worktree add
--detach DIR REV``); each tree runs in a process of its own with its own
``smr`` first on the path, against a fresh nats-server. A real Worker serves
a step that sleeps and succeeds. Printed per tree: the delay from the step's
end to the requester's return, for steps of several lengths (p50, p95,
max), and for ``--waiters`` requests at once on 3 s steps the wall time to
the last result and the nats-server's CPU seconds meanwhile."""

from __future__ import annotations

import argparse
import asyncio
import inspect
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

HERE = Path(__file__).resolve()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(n: int, waiters: int) -> dict[str, Any]:
    from smr import config
    from smr.bus import Bus, Worker
    from smr.contract.messages import CkptDone, CkptRequested, Target
    from smr.natsserver import NatsServer

    ended: dict[str, float] = {}

    class Sleeps:
        kind = "ckpt.requested"

        async def run(self, req: CkptRequested, progress: Any) -> CkptDone:
            await asyncio.sleep(float(req.checkpoint_id.split("-")[1]))
            ended[req.request_id] = time.monotonic()
            return CkptDone.for_request(req, status="succeeded", generation=1)

        async def recover(self, req: CkptRequested, state: dict[str, Any]) -> None:
            return None

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        srv = NatsServer(config.load().nats_server_binary(), Path(tmp))
        srv.start()
        assert srv.proc is not None
        nats_pid = srv.proc.pid
        bus = await Bus.connect(srv.url, name="bench")
        # A tree from before the step locks (smr/bus/liveness.py) takes none.
        kw: dict[str, Any] = {}
        if "locks" in inspect.signature(Worker).parameters:
            from smr.bus import StepLocks
            kw["locks"] = StepLocks(Path(tmp) / "steps")
        worker = Worker(bus, Sleeps(), "n1", service="bench", concurrency=waiters, **kw)
        task = asyncio.create_task(worker.run())
        await asyncio.wait_for(worker.idle.wait(), 20)

        def req(s: float) -> CkptRequested:
            return CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=f"s-{s}",
                                 target=Target.job(f"j{uuid.uuid4().hex[:8]}"), node="n1")

        for s in (0.0, 0.5, 3.0):
            delays = []
            for _ in range(n if s < 3 else max(3, n // 6)):
                r = req(s)
                await bus.request(r, timeout=60)
                delays.append(time.monotonic() - ended[r.request_id])
            q = statistics.quantiles(delays, n=20) if len(delays) > 1 else delays * 19
            out[f"step {s:g} s"] = {"p50": statistics.median(delays), "p95": q[18],
                                    "max": max(delays), "n": len(delays)}
        cpu0, t0 = _cpu_s(nats_pid), time.monotonic()
        many = [req(3.0) for _ in range(waiters)]
        await asyncio.gather(*(bus.request(r, timeout=120) for r in many))
        out[f"{waiters} at once, 3 s steps"] = {
            "wall": time.monotonic() - t0, "nats_cpu": _cpu_s(nats_pid) - cpu0,
            "last_delay": max(time.monotonic() - ended[r.request_id] for r in many)}
        worker.stop()
        await asyncio.wait_for(task, 20)
        await bus.close()
        srv.stop()
    return out


def run_tree(tree: Path, n: int, waiters: int) -> dict[str, Any]:
    # One nats-server for both: this tree's (a base checkout has no .tools).
    sys.path.insert(0, str(HERE.parent.parent))
    from smr import config
    env = dict(os.environ, PYTHONPATH=str(tree),
               SMR_NATS_SERVER=config.load({}).nats_server_binary())
    p = subprocess.run([sys.executable, str(HERE), "--measure", "--n", str(n),
                        "--waiters", str(waiters)], env=env, cwd=tree,
                       capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"{tree}: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=Path)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--waiters", type=int, default=200)
    ap.add_argument("--measure", action="store_true")
    a = ap.parse_args()
    if a.measure:
        print(json.dumps(asyncio.run(measure(a.n, a.waiters))))
        return 0
    trees = {"this tree": HERE.parent.parent}
    if a.base:
        trees = {"base": a.base.resolve(), **trees}
    results = {name: run_tree(t, a.n, a.waiters) for name, t in trees.items()}
    rows = next(iter(results.values())).keys()
    print(f"{'':28}" + "".join(f" | {name:<48}" for name in results))
    for row in rows:
        cells = []
        for r in results.values():
            v = r[row]
            cells.append(", ".join(f"{k} {x:.3f}" if isinstance(x, float) else f"{k} {x}"
                                   for k, x in v.items()))
        print(f"{row:28}" + "".join(f" | {c:<48}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
