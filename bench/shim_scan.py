"""What an idle node agent costs: its looks for the host's smr-init shims
(``host.shims``, every process's argv[0] from /proc), container starts every
0.25 s and preStop waits every 0.5 s, this tree side by side with another's
in one run:

    .venv/bin/python bench/shim_scan.py [--base DIR] [--procs 1000] [--seconds 10]

``--base DIR``: a checkout of the commit to compare with (``git worktree add
--detach DIR REV``). ``--procs`` idle processes are started first, as on a
busy node; each tree then runs in a process of its own, the two taking turns
in rounds so that a change in the machine's load falls on both. Printed per
tree: CPU milliseconds of one scan, and the share of one core the agent's two
loops take for ``--seconds`` (the preStop look 0.125 s after a starts look;
a tree whose ``shims`` takes ``max_age`` is called as the agent calls it)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()

PROBE = """
import inspect, json, sys, time
sys.path.insert(0, sys.argv[1])
from services.containers import host
scans, seconds = int(sys.argv[2]), float(sys.argv[3])
host.shims()  # imports and caches warmed
t = time.process_time()
for _ in range(scans):
    found = host.shims()
one = (time.process_time() - t) / scans * 1000
kw = ({"max_age": host.SCAN_MAX_AGE_S}
      if "max_age" in inspect.signature(host.shims).parameters else {})
now = time.monotonic()
end, starts, prestop = now + seconds, now, now + 0.125
t = time.process_time()
while (now := time.monotonic()) < end:
    if now >= starts:
        host.shims(**kw)
        starts += 0.25
    if now >= prestop:
        host.shims(**kw)
        prestop += 0.5
    time.sleep(max(0.0, min(starts, prestop) - time.monotonic()))
print(json.dumps({"ms": one, "core": (time.process_time() - t) / seconds * 100,
                  "pids": len(host.all_pids()), "shims": len(found)}))
"""


def scan(tree: Path, scans: int, seconds: float) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(tree), str(scans), str(seconds)],
                         capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, help="a checkout of the commit to compare with")
    ap.add_argument("--procs", type=int, default=1000, help="idle processes started first")
    ap.add_argument("--scans", type=int, default=100, help="scans timed one by one")
    ap.add_argument("--seconds", type=float, default=10.0, help="of the agent's loops")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    trees = {"this": HERE.parent.parent}
    if args.base:
        trees["base"] = args.base.resolve()
    idle = [subprocess.Popen(["sleep", "3600"]) for _ in range(args.procs)]
    try:
        got: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                got[name].append(scan(tree, args.scans, args.seconds))
    finally:
        for p in idle:
            p.kill()
        for p in idle:
            p.wait()
    print(f"{os.cpu_count()} cores; {got['this'][0]['pids']} processes on the host; "
          f"{args.rounds} rounds")
    print(f"{'tree':6} {'ms CPU a scan':>14} {'% of a core, idle agent':>24}  per round (%)")
    for name, runs in got.items():
        ms = statistics.median(r["ms"] for r in runs)
        core = statistics.median(r["core"] for r in runs)
        print(f"{name:6} {ms:14.2f} {core:24.1f}  "
              + " ".join(f"{r['core']:.1f}" for r in runs))

if __name__ == "__main__":
    main()
