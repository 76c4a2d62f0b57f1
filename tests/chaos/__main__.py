"""`python -m tests.chaos --cycles 200 --seed 7`: the full fault campaign
(tests/chaos/campaign.py); prints the table, exits 1 on any violation."""

from __future__ import annotations

import argparse
import asyncio
import sys

from smr import config
from tests.chaos.campaign import run


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    p.add_argument("--cycles", type=int, default=200)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workloads", type=int, default=3)
    p.add_argument("--keep", action="store_true", help="keep the node and job logs")
    p.add_argument("--cluster", action="store_true",
                   help="on a 3-server NATS cluster, with NATS leader kills and pauses")
    p.add_argument("--no-nats-users", action="store_true",
                   help="NATS without the shipped users and permissions "
                        "(the default runs each node as its own user, as deployed)")
    p.add_argument("--each-fault", action="store_true",
                   help="every fault kind in turn instead of at random")
    a = p.parse_args()
    report = asyncio.run(run(a.cycles, a.seed, config.load({}).criu_binary(), a.workloads,
                           keep=a.keep, each_fault=a.each_fault, cluster=a.cluster,
                           nats_users=not a.no_nats_users))
    users = not a.no_nats_users
    print(f"fault campaign: seed {a.seed}{', 3-server NATS cluster' if a.cluster else ''}"
          f"{' with the shipped NATS users' if users else ''}")
    print(report.table())
    for line in report.problems:
        print("  " + line)
    if report.violated() and not a.keep:
        print("(run again with --keep to keep the node logs and diagnostics)")
    return 1 if report.violated() else 0


if __name__ == "__main__":
    sys.exit(main())
