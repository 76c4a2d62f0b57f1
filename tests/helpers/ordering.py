"""The order pytest-xdist hands tests out in (`make test` runs them on
several workers, `--dist loadgroup` without reordering): the longest first,
so no worker starts a pod test of several minutes when the others are done.

No recorded durations are needed (a fresh clone has none): what a test
stands up says how long it takes. A two-node cluster with containerd
(tests/agent) takes minutes; an embedded node or CRIU, seconds to a minute;
the rest, well under a second. The sort is stable, so within a class the
files keep their order (and every worker collects the same order, which
xdist checks)."""

from __future__ import annotations

import pytest

# Fixtures that start a cluster of real containerd, runc and agents: minutes.
POD_FIXTURES = {"cluster", "containerd"}
# Fixtures that start an embedded node, nats-server with users, or CRIU: seconds.
NODE_FIXTURES = {"h", "criu_binary", "nats_users", "s3_endpoint"}


def rank(item: pytest.Item) -> int:
    names = set(getattr(item, "fixturenames", ()))
    if names & POD_FIXTURES:
        return 0
    if names & NODE_FIXTURES:
        return 1
    return 2


def longest_first(items: list[pytest.Item]) -> None:
    items.sort(key=rank)
