"""What one `smr` command costs before it does anything: the CPU and wall time
of `smr ps` against a running NATS (nats-server -js, started here), this
tree side by side with another's in one run:

    .venv/bin/python bench/cli_start.py [--base DIR] [--n 10]

``--base DIR``: a checkout of the commit to compare with (``git worktree add
--detach DIR REV``). The two trees take turns, one run each, so that a change
in the machine's load falls on both. Printed per tree: median CPU seconds
(user + system) and wall seconds of a run."""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from smr.config import REPO_TOOLS
from smr.natsserver import NatsServer

HERE = Path(__file__).resolve()


def nats_binary() -> str:
    found = shutil.which("nats-server") or str(REPO_TOOLS / "nats-server")
    if not Path(found).exists():
        sys.exit("no nats-server: run `make setup` first")
    return found


def one(tree: Path, url: str, data: Path) -> tuple[float, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "SMR_NATS_URL": url,
           "SMR_DATA_DIR": str(data), "HOME": str(data)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.monotonic()
    subprocess.run([sys.executable, "-m", "smrctl.cli", "ps"], cwd=tree, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    wall = time.monotonic() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, help="a checkout of the commit to compare with")
    ap.add_argument("--n", type=int, default=10, help="runs of each tree")
    args = ap.parse_args()
    trees = {"this": HERE.parent.parent}
    if args.base:
        trees["base"] = args.base.resolve()
    with tempfile.TemporaryDirectory(prefix="smr-cli-bench-") as d:
        server = NatsServer(nats_binary(), Path(d) / "js").start()
        try:
            got: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
            for _ in range(args.n):
                for name, tree in trees.items():
                    got[name].append(one(tree, server.url, Path(d)))
        finally:
            server.stop()
    print(f"`smr ps` against a running NATS, {args.n} runs a tree, {os.cpu_count()} cores")
    print(f"{'tree':6} {'CPU s':>7} {'wall s':>7}")
    for name, runs in got.items():
        print(f"{name:6} {statistics.median(c for c, _ in runs):7.2f} "
              f"{statistics.median(w for _, w in runs):7.2f}")


if __name__ == "__main__":
    main()
