"""The order pytest-xdist hands tests out in, and which tests may run at once
(`make test` with TEST_WORKERS > 0).

Order: the longest first, so no worker starts a pod test of several minutes
when the others are done. No recorded durations are needed (a fresh clone
has none): what a test stands up says how long it takes. A two-node cluster
with containerd (tests/agent) takes minutes; an embedded node or CRIU,
seconds to a minute; the rest, well under a second. The sort is stable, so
within a class the files keep their order (and every worker collects the
same order, which xdist checks).

At once: the pod tests run in lanes (TEST_POD_LANES, one by default), each
lane one work unit that a single worker runs test after test, so no more pod
tests run at a time than there are lanes, whatever the number of workers.
A pod test's deadlines (a preStop's grace, a container's start) are a real
kubelet's; three of them at once on two cores stretched those past their
limits, while the many short tests fill the other workers. pytest-xdist
groups by a mark that renames the node id, which pytest 9 refuses, so the
lanes come from a scheduler of our own (`Lanes`): the workers write down
which node ids are pod tests as they collect, and it reads that."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from xdist.scheduler.loadscope import LoadScopeScheduling

# Fixtures that start a cluster of real containerd, runc and agents: minutes.
POD_FIXTURES = {"cluster", "containerd"}
# Fixtures that start an embedded node, nats-server with users, or CRIU: seconds.
NODE_FIXTURES = {"h", "criu_binary", "nats_users", "s3_endpoint"}
# Where the controller tells its workers to write down the pod tests' lanes.
LANES_FILE_ENV = "SMR_TEST_LANES_FILE"
LANES_ENV = "TEST_POD_LANES"


def rank(item: pytest.Item) -> int:
    names = set(getattr(item, "fixturenames", ()))
    if names & POD_FIXTURES:
        return 0
    if names & NODE_FIXTURES:
        return 1
    return 2


def longest_first(items: list[pytest.Item]) -> None:
    items.sort(key=rank)


def lanes(items: list[pytest.Item], count: int) -> dict[str, int]:
    """Each pod test's lane: whole files dealt to the lane with the fewest
    tests so far, so a file's tests keep their order and share a worker."""
    files: dict[str, list[str]] = {}
    for item in items:
        if rank(item) == 0 and item.nodeid.startswith("tests/agent/"):
            files.setdefault(item.nodeid.split("::", 1)[0], []).append(item.nodeid)
    sizes = [0] * max(1, count)
    lane_of: dict[str, int] = {}
    for nodeids in files.values():
        lane = sizes.index(min(sizes))
        sizes[lane] += len(nodeids)
        lane_of.update(dict.fromkeys(nodeids, lane))
    return lane_of


def write_lanes(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker: write down each pod test's lane for `Lanes` (every worker
    writes the same, so the last rename wins harmlessly)."""
    path = os.environ.get(LANES_FILE_ENV)
    if not path or not hasattr(config, "workerinput"):
        return
    count = int(os.environ.get(LANES_ENV) or 1)
    text = "".join(f"{lane}\t{nodeid}\n" for nodeid, lane in lanes(items, count).items())
    tmp = Path(f"{path}.{config.workerinput['workerid']}")
    tmp.write_text(text)
    tmp.rename(path)


class Lanes(LoadScopeScheduling):
    """Load scheduling, one test per work unit, except that each lane of pod
    tests is one work unit: the worker it goes to runs them one by one."""

    def __init__(self, config: pytest.Config, log: object = None) -> None:
        super().__init__(config, log)
        self._lane_of: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._lane_of is None:
            # Called first by schedule(), once every worker has collected
            # (and so written the file).
            text = Path(os.environ[LANES_FILE_ENV]).read_text()
            self._lane_of = {nodeid: f"pod-lane-{lane}" for lane, nodeid in
                             (line.split("\t", 1) for line in text.splitlines())}
        return self._lane_of.get(nodeid, nodeid)
