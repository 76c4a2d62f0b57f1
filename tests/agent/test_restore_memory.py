"""A restore of a workload larger than the agent's memory limit succeeds, and
the restored memory is the pod's. CRIU restores inside the container's
cgroups, so the restored tree's pages are charged to the pod's memory limit;
the agent streams the images to CRIU through a bounded amount of its own
memory (services/storage/download), whatever the workload's size. The agent
runs here as the DaemonSet runs it, a process held to a memory limit by its
cgroup; the kernel would kill it for more."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import Path

import pytest

from services.containers import host
from services.containers.pods import runtime_id
from tests import oci_image
from tests.agent.agent_process import oom_kills, peak
from tests.agent.cluster import COUNTER, Cluster, assert_continues, steps, workload

IMAGE = "smr.test/ballast:1"
MIB = 512
# The agent's limit: below the workload. Its own memory is inside it: about
# 77 MiB idle, 233-259 MiB at its peak restoring 512 MiB here (the download's
# bounded read-ahead, CRIU's queue, the S3 client); with the read-ahead
# bounded by a count of ranges alone, 362-507 MiB without a limit, and killed
# under this one.
LIMIT_MIB = 320
# Holds MIB MiB of memory, every page written, and checks it every second:
# the part of the tree whose pages must come back, intact, charged to the pod.
BALLAST = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    size_t n = (size_t)atoi(argv[1]) << 20;
    unsigned char *p = malloc(n);
    for (size_t i = 0; i < n; i += 2048) p[i] = (unsigned char)(i >> 11) | 1;
    for (unsigned k = 0;; k++) {
        size_t bad = 0;
        for (size_t i = 0; i < n; i += 2048) bad += p[i] != ((unsigned char)(i >> 11) | 1);
        printf("ballast %u %s\n", k, bad ? "corrupt" : "intact");
        fflush(stdout);
        sleep(1);
    }
}
"""


def build_ballast_image(d: Path, image: str, mib: int) -> Path:
    """An image whose /bin/start runs BALLAST of ``mib`` MiB beside the counter."""
    (d / "ballast.c").write_text(BALLAST)
    subprocess.run(["gcc", "-static", "-O2", "-o", d / "ballast", d / "ballast.c"], check=True)
    start = f"#!/bin/sh\n/bin/ballast {mib} &\nexec /bin/counter\n".encode()
    return oci_image.build(d / "ballast.tar", image, files={
        "/bin/counter": COUNTER, "/bin/start": start,
        "/bin/ballast": (d / "ballast").read_bytes()})


@pytest.fixture(scope="module")
def ballast_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_ballast_image(tmp_path_factory.mktemp("ballast"), IMAGE, MIB)


def memory_charged(pid: int) -> int:
    """Bytes charged to the memory cgroup of ``pid`` (v1 or v2)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return int(Path(f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes").read_text())
        if controllers == "" and (f := Path(f"/sys/fs/cgroup{path}/memory.current")).is_file():
            return int(f.read_text())
    raise AssertionError(f"no memory cgroup for pid {pid}")


async def ballast_checks(cluster: Cluster, name: str, node: str) -> list[str]:
    """The restored ballast's own checks of its memory, once it made one."""
    deadline = time.monotonic() + 30
    while not (got := re.findall(r"^ballast \d+ (\w+)$", cluster.log(name, node), re.M)):
        assert time.monotonic() < deadline, f"the ballast on {node} never checked its memory"
        await asyncio.sleep(0.2)
    return got


@pytest.mark.agent_process(memory_limit=LIMIT_MIB << 20)
async def test_a_restore_larger_than_the_agents_memory_limit(cluster: Cluster,
                                                             ballast_image: Path) -> None:
    a, b = list(cluster.kubelets)
    agent = cluster.agent_process
    assert agent is not None
    for node, kubelet in cluster.kubelets.items():
        await kubelet.ctd.import_image(node, ballast_image)
    p = workload("big", a, image=IMAGE, labels={"smr.dev/node-restore": "true"})
    p["spec"]["containers"][0]["command"] = ["/smr/smr-init", "--", "/bin/start"]
    cluster.kube.put("pods", p)
    await cluster.until_steps("big", a, 5)
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    await cluster.latest("big.main", timeout=60)
    before = steps(cluster.log("big", a))
    cluster.kube.remove("pods", "big", "default",  # a drain: its final checkpoint
                        disruption="EvictionByEvictionAPI")
    await cluster.recreated("big")
    before = steps(cluster.log("big", a)) or before
    # Restored on node b, by its agent: a process held to LIMIT_MIB, less
    # than the workload it restores.
    cluster.schedule("big", b)
    deadline = time.monotonic() + 90
    try:
        while len(after := steps(cluster.log("big", b))) < 5:
            assert not oom_kills(agent.cgroup), \
                f"the kernel killed the agent for its {LIMIT_MIB} MiB limit:\n{agent.tail()}"
            assert agent.proc.poll() is None, f"the agent exited:\n{agent.tail()}"
            assert time.monotonic() < deadline, \
                f"pod big was not restored on {b}; the agent's log:\n{agent.tail()}"
            await asyncio.sleep(0.2)
    finally:
        print(f"the agent's peak charge: {peak(agent.cgroup) >> 20} MiB "
              f"(limit {LIMIT_MIB} MiB, workload {MIB} MiB)")
    # The ballast's memory came back: the counter continues, and the pod's
    # cgroup holds the restored MIB MiB, not the agent's.
    assert_continues(before, after, before[-1][0])
    checks = await ballast_checks(cluster, "big", b)
    assert "corrupt" not in checks, f"the restored ballast's memory changed: {checks}"
    pod = cluster.kube.get("pods", "big", "default")
    assert pod is not None
    shim = host.find_shim(runtime_id(pod["status"]["containerStatuses"][0]["containerID"]))
    assert shim is not None
    charged = memory_charged(shim.pid)
    assert charged >= MIB << 20, \
        f"the pod's cgroup holds {charged >> 20} MiB; the restored {MIB} MiB went elsewhere"
