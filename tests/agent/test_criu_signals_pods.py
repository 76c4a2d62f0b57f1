"""What a tenant can do to the agent's CRIU through the PID namespace they
share: stop it, and see its capabilities. Real containerd, runc and CRIU.

CRIU dumps and restores a container's tree from inside the container's PID
namespace, where the workload's root can signal it. A process of the tenant
outside the dumped tree (here an orphan of the workload, reparented to
smr-init, as a sidecar sharing the PID namespace would be) finds CRIU in
/proc and stops it, again and again: the agent continues it each time, and
the checkpoint ends long before CRIU's timeout with the workload running on.
The same process reads CRIU's bounding set: only what CRIU uses, and what the
container holds.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from services.containers import host, incontainer
from services.containers.pods import runtime_id
from smr.process.criu import Criu
from smr.process.tree import process_tree
from tests import oci_image
from tests.agent.cluster import COUNTER, Cluster, steps, workload
from tests.agent.test_attacks import _smr_file, checkpoint

IMAGE = "smr.test/criu-signals:1"
# $MODE stop: stop every process running with the agent's loader's
# --library-path (CRIU), in a loop, noting each in /smr/stopped; caps:
# /bin/capwatch notes the first CRIU's capabilities. Then the counter.
TENANT = b"""#!/bin/sh
case "$MODE" in
stop) ( ( while true; do
          for d in /proc/[0-9]*; do
            grep -q library-path $d/cmdline 2>/dev/null || continue
            kill -STOP ${d#/proc/} && echo "stopped ${d#/proc/}" >> /smr/stopped
          done
        done ) & ) & ;;
caps) ( /bin/capwatch & ) & ;;
esac
exec /bin/counter
"""
# Copies the capability lines of the first process it finds running with
# --library-path (CRIU) from its /proc/PID/status to /smr/criu-caps, and
# exits. It looks every millisecond: a dump of the small counter can take
# less than a tenth of a second, which a shell loop forking grep per process
# misses on a loaded machine, and one look costs some microseconds.
CAPWATCH = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
static ssize_t slurp(const char *pid, const char *file, char *buf, size_t size) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%s/%s", pid, file);
    int fd = open(path, O_RDONLY);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n >= 0) buf[n] = 0;
    return n;
}
static int note(const char *pid) {
    char status[8192], out[1024] = "";
    if (slurp(pid, "status", status, sizeof status) <= 0) return 0;
    for (char *ln = strtok(status, "\n"); ln; ln = strtok(NULL, "\n"))
        if (!strncmp(ln, "Cap", 3) && strlen(out) + strlen(ln) + 2 < sizeof out)
            strcat(strcat(out, ln), "\n");
    if (!*out) return 0;
    FILE *f = fopen("/smr/criu-caps.x", "w");
    if (!f || fputs(out, f) < 0 || fclose(f)) return 0;
    return rename("/smr/criu-caps.x", "/smr/criu-caps") == 0;
}
int main(void) {
    const struct timespec ms = {0, 1000000};
    for (;;) {
        DIR *d = opendir("/proc");
        struct dirent *e;
        char cmd[4096];
        ssize_t n;
        while (d && (e = readdir(d)))
            if (*e->d_name >= '0' && *e->d_name <= '9'
                && (n = slurp(e->d_name, "cmdline", cmd, sizeof cmd)) > 0
                && memmem(cmd, n, "--library-path", 14) && note(e->d_name))
                return 0;
        if (d) closedir(d);
        nanosleep(&ms, NULL);
    }
}
"""
# Drops net_raw and mknod from its bounding set (so from everything it runs
# as root), then runs the rest of its arguments: a non-default set of
# capabilities a restore must give back.
CAPDROP = r"""
#include <sys/prctl.h>
#include <unistd.h>
int main(int argc, char **argv) {
    (void)argc;
    if (prctl(PR_CAPBSET_DROP, 13, 0, 0, 0) || prctl(PR_CAPBSET_DROP, 27, 0, 0, 0)) return 111;
    execv(argv[1], argv + 1);
    return 112;
}
"""
# Never in CRIU's bounding set unless the container holds it (a default
# container holds none of them), by number (linux/capability.h).
DROPPED = {16: "sys_module", 17: "sys_rawio", 22: "sys_boot", 34: "syslog", 38: "perfmon",
           39: "bpf"}
CRIU_TIMEOUT = 40.0


@pytest.fixture(autouse=True)
def criu_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-process agents give each CRIU run CRIU_TIMEOUT: held by a
    stopped CRIU, a checkpoint would end only at SMR_CRIU_TIMEOUT (600 s by
    default), long past the test's request."""
    inside = incontainer.CriuBundle.inside

    async def short(self: incontainer.CriuBundle, shim: host.Shim, timeout: float,
                    *args: Any, **kwargs: Any) -> Criu:
        return await inside(self, shim, min(timeout, CRIU_TIMEOUT), *args, **kwargs)

    monkeypatch.setattr(incontainer.CriuBundle, "inside", short)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("criu-signals")
    for name, source in (("capdrop", CAPDROP), ("capwatch", CAPWATCH)):
        (d / f"{name}.c").write_text(source)
        subprocess.run(["gcc", "-static", "-O2", "-o", d / name, d / f"{name}.c"], check=True)
    return oci_image.build(d / "img.tar", IMAGE, files={
        "/bin/counter": COUNTER, "/bin/tenant": TENANT,
        "/bin/capdrop": (d / "capdrop").read_bytes(),
        "/bin/capwatch": (d / "capwatch").read_bytes()})


@pytest.fixture
async def signals(cluster: Cluster, image: Path) -> Cluster:
    for node, kubelet in cluster.kubelets.items():
        await kubelet.ctd.import_image(node, image)
    return cluster


def tenant(name: str, node: str, mode: str) -> dict[str, object]:
    p = workload(name, node, image=IMAGE, labels={"smr.dev/node-restore": "true"},
                 env={"MODE": mode})
    p["spec"]["containers"][0]["command"] = [  # type: ignore[index]
        "/smr/smr-init", "--", "/bin/capdrop", "/bin/tenant"]
    return p


def _shim(cluster: Cluster, pod: str) -> host.Shim:
    st = cluster.kube.get("pods", pod, "default")
    assert st is not None
    shim = host.find_shim(runtime_id(st["status"]["containerStatuses"][0]["containerID"]))
    assert shim is not None, f"no container of {pod}"
    return shim


def _workload(cluster: Cluster, pod: str) -> int:
    w = _shim(cluster, pod).workload()
    assert w is not None, f"{pod} runs no workload"
    return w[0]


def _caps(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(ln.split(":\t") for ln in lines if ln.startswith("Cap"))


# Alone (`make test`'s serial run): it times a checkpoint against CRIU's timeout,
# which other workers' dumps on the same cores would stretch.
@pytest.mark.serial
async def test_a_tenant_stopping_criu_holds_no_checkpoint(signals: Cluster) -> None:
    """An orphan of the workload stops CRIU over and over during a
    checkpoint: the agent continues it each time, the checkpoint succeeds
    well within CRIU's timeout, and the workload runs on, never left frozen."""
    cluster = signals
    a, _ = list(cluster.kubelets)
    cluster.kube.put("pods", tenant("stopper", a, "stop"))
    await cluster.until_steps("stopper", a, 5)
    t = time.monotonic()
    done = await checkpoint(cluster, "stopper", a, "stopper.main")
    took = time.monotonic() - t
    stopped = await _smr_file(cluster, "stopper", "stopped")
    assert stopped, "the tenant never found CRIU to stop: the test proves nothing"
    assert done.status == "succeeded", (
        f"a checkpoint the tenant stopped CRIU in ({len(stopped.splitlines())} stops) "
        f"failed after {took:.0f}s: {done.error}")
    assert took < CRIU_TIMEOUT, f"the checkpoint waited out CRIU's timeout: {took:.0f}s"
    # Not left frozen: the workload counts on, and no process of it is stopped.
    n = len(steps(cluster.log("stopper", a)))
    await cluster.until_steps("stopper", a, n + 5)
    root = _workload(cluster, "stopper")
    frozen = [p for p in process_tree(root)
              if Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt"]
    assert not frozen, f"the workload is left stopped: {frozen}"


async def test_criu_holds_only_the_capabilities_it_uses(signals: Cluster) -> None:
    """CRIU's bounding set, as a process of the container reads it during a
    dump, lacks what CRIU never uses (modules, raw I/O, BPF, ...), holds what
    the container holds; and a workload with a non-default capability set
    migrates with that set, exactly."""
    cluster = signals
    a, b = list(cluster.kubelets)
    cluster.kube.put("pods", tenant("caps", a, "caps"))
    await cluster.until_steps("caps", a, 5)
    shim = _shim(cluster, "caps")
    container = int(_caps(shim.pid)["CapBnd"], 16)
    before = _caps(_workload(cluster, "caps"))
    assert before["CapBnd"] != _caps(shim.pid)["CapBnd"], "capdrop changed nothing"
    # A dump the tenant was not scheduled during is not seen: another one.
    for _ in range(5):
        done = await checkpoint(cluster, "caps", a, "caps.main")
        assert done.status == "succeeded", done.error
        seen = dict(ln.split(":\t") for ln in (await _smr_file(cluster, "caps", "criu-caps"))
                    .splitlines())
        if seen:
            break
    assert seen, "the tenant never saw CRIU in 5 checkpoints: the test proves nothing"
    bnd = int(seen["CapBnd"], 16)
    assert not container & sum(1 << i for i in DROPPED), "the test needs a default container"
    kept = [n for i, n in DROPPED.items() if bnd >> i & 1]
    assert not kept, f"CRIU's bounding set ({seen['CapBnd']}) holds what it never uses: {kept}"
    assert bnd & container == container, (
        f"CRIU's bounding set ({seen['CapBnd']}) lacks some of the container's ({container:x})")
    assert int(seen["CapInh"], 16) == 0, seen

    # Migrated: CRIU restores the tree with the capabilities it was dumped with.
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    await cluster.latest("caps.main", after=done.generation)
    await cluster.drained_to("caps", a, b, steps(cluster.log("caps", a)))
    after = _caps(_workload(cluster, "caps"))
    assert after == before, f"the restored workload's capabilities differ: {before} -> {after}"
