"""A tenant's container attacks the node agent. Real containerd,
runc and CRIU; each attempt must fail, leave the host's files untouched and
be reported (docs/security.md lists them).

The hostile workload (/bin/hostile) starts one attack in the background, by
$ATTACK, and then runs the counter of tests/agent/cluster.py, whose memory
and writable layer a migration must carry as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import stat
import subprocess
import sysconfig
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.containers import host
from services.containers.host import Shim
from smr.contract.messages import CkptDone, CkptRequested, Target
from smr.process import procfs
from smr.process.criu import Criu
from tests import oci_image
from tests.agent.cluster import COUNTER, Cluster, steps, workload
from tests.agent.opens import Opens

HOSTILE_IMAGE = "smr.test/hostile:1"
MARKER_DIR = Path("/tmp")  # the markers' names are random per test run

HOSTILE = b"""#!/bin/sh
S=/smr/main
case "$ATTACK" in
hold-link) (sleep 1; ln -sf "$CANARY" $S/hold; ln -sf "$CANARY" $S/decision.tmp) & ;;
status-link) (sleep 1; ln -sf "$CANARY" $S/status.x; mv $S/status.x $S/status) & ;;
status-fifo) (sleep 1; mkfifo $S/status.x; mv $S/status.x $S/status) & ;;
lock-link) (sleep 1; ln -sf "$CANARY" $S/signal.lock) & ;;
final-link) (sleep 1; ln -sf "$CANARY" $S/final; ln -sf "$CANARY" $S/final.tmp
             ln -sf "$CANARY" $S/.final.smr-tmp) & ;;
images) (while true; do
           for f in $S/work/*/images/*.img $S/work/*/images/*/*.img; do
             test -f "$f" && echo garbage > "$f"
           done
         done) & ;;
swap) (mkdir -p /data/d; echo mine > /data/d/f
       while true; do
         mv /data/d /data/d.real; ln -s "$SECRET_DIR" /data/d; rm /data/d; mv /data/d.real /data/d
       done) & ;;
shm-swap) (mkdir -p /dev/shm/d; echo mine > /dev/shm/d/f
           ln -s "$SECRET_DIR/host-secret-0" /dev/shm/link
           while true; do
             mv /dev/shm/d /dev/shm/d.real; ln -s "$SECRET_DIR" /dev/shm/d; rm /dev/shm/d
             mv /dev/shm/d.real /dev/shm/d
           done) & ;;
dev-nodes) (sleep 1; M=/tmp/state/main; mkdir -p $S $M
            mknod $S/status.x c 1 3; mv $S/status.x $S/status
            mknod $M/status.x c 1 3; mv $M/status.x $M/status) & ;;
lock-dev) (sleep 1; mknod $S/signal.lock.x c 1 3; mv $S/signal.lock.x $S/signal.lock) & ;;
esac
exec /bin/counter
"""

# Loaded by glibc for a user lookup when /etc/nsswitch.conf names "evil":
# from any chroot it joins its own mount namespace again through a pidfd
# (which puts its root back at the host's) and leaves a marker on the host.
NSS_MODULE = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
__attribute__((constructor)) static void evil(void) {
    int pidfd = syscall(SYS_pidfd_open, getpid(), 0);
    if (pidfd >= 0) setns(pidfd, CLONE_NEWNS);
    int fd = open(MARKER, O_WRONLY | O_CREAT, 0644);
    if (fd >= 0) { (void)!write(fd, "nss\n", 4); close(fd); }
}
"""

TRACEBACK = """
import ctypes, os
try:
    ctypes.CDLL(None).setns(os.pidfd_open(os.getpid()), 0x00020000)  # CLONE_NEWNS
except OSError:
    pass
open(MARKER, "w").write("traceback\\n")
"""


# Code an image can hand to a CRIU that reads its files: a CRIU plugin in
# /usr/lib/criu/, a library named in /etc/ld.so.preload (the dynamic loader
# maps it into every program started with the image's root as `/`), an NSS
# module (glibc loads it for a lookup the image's nsswitch.conf names). Run with
# the agent's powers (CAP_SYS_ADMIN, which the tenant lacks), it notes what it
# is in the container's /smr (the agent cannot miss it: it is outside the
# captured layer) and walks up from every descriptor it holds to the host's
# /tmp, where it leaves a marker.
CRIU_EVIL = r"""
#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <linux/capability.h>
#include <sys/syscall.h>
__attribute__((constructor)) static void evil(void) {
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    if (syscall(SYS_capget, &h, d) || !(d[0].effective & (1u << CAP_SYS_ADMIN))) return;
    FILE *f = fopen("/smr/criu-evidence", "a");
    if (f) { fprintf(f, "%s ran as uid %d\n", VECTOR, getuid()); fclose(f); }
    DIR *fds = opendir("/proc/self/fd");
    struct dirent *e;
    char p[512];
    while (fds && (e = readdir(fds))) {
        snprintf(p, sizeof p, "/proc/self/fd/%s/../../../../../../../../../../../..%s",
                 e->d_name, MARKER);
        FILE *m = fopen(p, "a");
        if (m) { fprintf(m, "%s\n", VECTOR); fclose(m); }
    }
}
"""

# CRIU runs the action scripts its configuration names, at every stage.
CRIU_ACTION = b"""#!/bin/sh
echo "action-script ran at $CRTOOLS_SCRIPT_ACTION" >> /smr/criu-evidence
"""
CRIU_IMAGE = "smr.test/criu-hostile:1"
NSS_DATABASES = (b"passwd", b"group", b"shadow", b"hosts", b"networks", b"protocols",
                 b"services", b"ethers", b"rpc", b"netgroup")


@pytest.fixture(scope="module")
def markers() -> Iterator[dict[str, Path]]:
    run = uuid.uuid4().hex[:8]
    paths = {k: MARKER_DIR / f"smr-attack-{run}-{k}" for k in ("nss", "traceback")}
    yield paths
    for p in paths.values():
        p.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def hostile_image(tmp_path_factory: pytest.TempPathFactory, markers: dict[str, Path]) -> Path:
    d = tmp_path_factory.mktemp("hostile")
    src = d / "evil.c"
    src.write_text(NSS_MODULE.replace("MARKER", f'"{markers["nss"]}"'))
    so = d / "libnss_evil.so.2"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", so, src], check=True)
    module = so.read_bytes()
    # The agent's Python would find its stdlib at this path inside a chroot.
    stdlib = sysconfig.get_paths()["stdlib"]
    files = {"/bin/counter": COUNTER, "/bin/hostile": HOSTILE,
             "/etc/nsswitch.conf": b"passwd: evil\ngroup: evil\nshadow: evil\n",
             f"{stdlib}/traceback.py":
                 TRACEBACK.replace("MARKER", repr(str(markers["traceback"]))).encode()}
    for lib in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib"):
        files[f"{lib}/libnss_evil.so.2"] = module
    links = {f"bin/{a}": "busybox" for a in ("ln", "mkfifo", "mv", "mknod", "mkdir")}
    return oci_image.build(d / "hostile.tar", HOSTILE_IMAGE, files=files, links=links)


@pytest.fixture
async def hostile(cluster: Cluster, hostile_image: Path) -> Cluster:
    for node, kubelet in cluster.kubelets.items():
        await kubelet.ctd.import_image(node, hostile_image)
    return cluster


def attacker(name: str, node: str | None, attack: str, **env: str) -> dict[str, Any]:
    p = workload(name, node, image=HOSTILE_IMAGE, labels={"smr.dev/node-restore": "true"},
                 env={"ATTACK": attack, **env})
    p["spec"]["containers"][0]["command"] = ["/smr/smr-init", "--", "/bin/hostile"]
    return p


async def checkpoint(cluster: Cluster, pod: str, node: str, ckpt: str) -> CkptDone:
    done = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=ckpt, node=node, leave_running=True,
        target=Target(kind="pod", namespace="default", pod=pod, container="main")),
        timeout=60)
    assert isinstance(done, CkptDone)
    return done


async def test_image_nss_module_and_traceback_never_run_in_the_agent(
        hostile: Cluster, markers: dict[str, Path]) -> None:
    """Attack 1: the layer restore must load nothing from the image."""
    a, b = list(hostile.kubelets)
    hostile.kube.put("pods", attacker("nss", a, "none"))
    await hostile.until_steps("nss", a, 5)
    await hostile.core.patch_node(a, {"spec": {"unschedulable": True}})
    await hostile.latest("nss.main")
    before = steps(hostile.log("nss", a))
    try:
        await hostile.drained_to("nss", a, b, before)  # restored, layer and all
        await hostile.event("Restored", "nss")
    finally:
        for what, marker in markers.items():
            assert not marker.exists(), f"the image's {what} code ran as root on the host"


async def test_symlinks_in_smr_are_refused_and_reported(hostile: Cluster,
                                                        tmp_path: Path) -> None:
    """Attack 2: `hold`, `decision.tmp` and `status` pointed at host files."""
    a, _ = list(hostile.kubelets)
    canary = tmp_path / "host-canary"
    canary.write_text("host-secret-7f3a\n")
    hostile.kube.put("pods", attacker("holder", a, "hold-link", CANARY=str(canary)))
    hostile.kube.put("pods", attacker("leaker", a, "status-link", CANARY=str(canary)))
    await hostile.until_steps("holder", a, 15)
    await hostile.until_steps("leaker", a, 15)

    for pod in ("holder", "leaker"):
        done = await checkpoint(hostile, pod, a, f"{pod}-1")
        assert canary.read_text() == "host-secret-7f3a\n", f"{pod}: the agent wrote through a link"
        assert "host-secret" not in str(done.error), f"{pod}: a host file leaked: {done.error}"
        assert done.status == "failed", f"{pod}: a checkpoint through a planted link"
        assert done.error["code"] == "unsafe-path-in-container", done.error
        event = await hostile.event("CheckpointFailed", pod)
        assert "symlink" in event["message"], event["message"]
    # The refusals left the workloads running.
    n = len(steps(hostile.log("holder", a)))
    await hostile.until_steps("holder", a, n + 3)


async def test_signal_lock_and_final_links_are_not_followed(hostile: Cluster,
                                                            tmp_path: Path) -> None:
    """Attack 2, the step's own files in the container: `signal.lock` (which
    the agent opens and flocks to take its hold) and `final`, `final.tmp`
    (where it tells the preStop hook how a final checkpoint went) pointed at
    a host file."""
    a, _ = list(hostile.kubelets)
    canary = tmp_path / "host-canary"
    canary.write_text("host-secret-7f3a\n")
    mtime = canary.stat().st_mtime_ns
    hostile.kube.put("pods", attacker("locker", a, "lock-link", CANARY=str(canary)))
    hostile.kube.put("pods", attacker("finisher", a, "final-link", CANARY=str(canary)))
    await hostile.until_steps("locker", a, 15)
    await hostile.until_steps("finisher", a, 15)

    done = await checkpoint(hostile, "locker", a, "locker-1")
    assert done.status == "failed", "a checkpoint took its hold through a planted link"
    assert done.error["code"] == "unsafe-path-in-container", done.error
    assert "signal.lock" in done.error["message"], done.error
    event = await hostile.event("CheckpointFailed", "locker")
    assert "symlink" in event["message"], event["message"]
    n = len(steps(hostile.log("locker", a)))
    await hostile.until_steps("locker", a, n + 3)  # the refusal left it running

    final = await hostile.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id="finisher-1", node=a, leave_running=False,
        target=Target(kind="pod", namespace="default", pod="finisher", container="main")),
        timeout=60)
    assert isinstance(final, CkptDone)
    assert final.status == "succeeded", final.error  # the outcome is written beside the link
    assert canary.read_text() == "host-secret-7f3a\n", "the agent wrote through a link"
    assert canary.stat().st_mtime_ns == mtime, "the agent touched the host file"


async def test_fifo_status_stalls_nothing(hostile: Cluster) -> None:
    """Attack 2: a FIFO as `status` must not block the agent (its event loop
    serves every pod of the node)."""
    a, _ = list(hostile.kubelets)
    hostile.kube.put("pods", attacker("fifo", a, "status-fifo"))
    hostile.kube.put("pods", attacker("bystander", a, "none"))
    await hostile.until_steps("fifo", a, 15)
    await hostile.until_steps("bystander", a, 3)
    done = await asyncio.wait_for(checkpoint(hostile, "fifo", a, "fifo-1"), 60)
    assert done.status == "failed" and done.error["code"] == "unsafe-path-in-container"
    assert "a FIFO" in done.error["message"], done.error
    await hostile.event("CheckpointFailed", "fifo")
    other = await asyncio.wait_for(checkpoint(hostile, "bystander", a, "bystander-1"), 60)
    assert other.status == "succeeded", other.error


async def test_device_nodes_where_smrs_files_are_are_never_opened(
        hostile: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Device nodes the workload makes in place of `status` and
    `signal.lock` (containers may mknod; opening a device can arm a watchdog
    or reset hardware): the agent refuses them without opening them, and a
    status refused once is not looked at again on the next scans. A pod that
    sets SMR_INIT_DIR moves smr-init's files only: the agent reads /smr."""
    a, _ = list(hostile.kubelets)
    reads: dict[int, int] = {}
    scans = [0]
    status, shims = Shim.status, host.shims

    def counted_status(self: Shim) -> list[str]:
        reads[self.pid] = reads.get(self.pid, 0) + 1
        return status(self)

    def counted_shims(max_age: float = 0.0) -> list[Shim]:
        scans[0] += 1
        return shims(max_age)

    monkeypatch.setattr(Shim, "status", counted_status)
    monkeypatch.setattr(host, "shims", counted_shims)

    async def scanned(n: int) -> None:
        """Until both agents scanned this node's containers n more times."""
        until = scans[0] + 2 * n
        for _ in range(600):
            if scans[0] >= until:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the agents stopped scanning")

    hostile.kube.put("pods", attacker("mover", a, "dev-nodes", SMR_INIT_DIR="/tmp/state",
                                      SMR_INIT_TIMEOUT="3"))
    hostile.kube.put("pods", attacker("lockdev", a, "lock-dev"))
    await hostile.until_steps("mover", a, 5)
    await hostile.until_steps("lockdev", a, 5)
    pids = {procfs.env_value(s.pid, "ATTACK"): s.pid for s in shims()}
    planted = [f"/proc/{pids['dev-nodes']}/root/smr/main/status",
               f"/proc/{pids['dev-nodes']}/root/tmp/state/main/status",
               f"/proc/{pids['lock-dev']}/root/smr/main/signal.lock"]
    for path in planted:
        for _ in range(100):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISCHR(os.lstat(path).st_mode):
                    break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"{path} was not made a device node")
    opens = Opens()
    try:
        for path in planted:
            opens.watch(path)
        await scanned(4)
        before = reads.get(pids["dev-nodes"], 0)
        await scanned(8)
        assert reads.get(pids["dev-nodes"], 0) == before, \
            "a status refused once was read again on the next scans"

        locked = await checkpoint(hostile, "lockdev", a, "lockdev-1")
        moved = await checkpoint(hostile, "mover", a, "mover-1")
        assert not (got := opens.opened()), f"the agent opened the planted device nodes: {got}"
    finally:
        opens.close()
    assert locked.status == "failed", "a hold was taken on a device node"
    assert locked.error["code"] == "unsafe-path-in-container", locked.error
    assert "signal.lock" in locked.error["message"], locked.error
    assert moved.status == "failed" and moved.error["code"] == "unsafe-path-in-container"
    assert "/smr/main/status" in moved.error["message"], moved.error
    # smr-init in the moved directory got no answer: its own timeout started it.
    assert "no answer from the smr node agent" in hostile.log("mover", a)
    n = len(steps(hostile.log("lockdev", a)))
    await hostile.until_steps("lockdev", a, n + 3)  # the refusals left it running


async def test_workload_cannot_edit_its_images_before_upload(hostile: Cluster) -> None:
    """Attack 3: after a leave-running dump the workload runs on; the images
    it could reach would be stored as it edited them."""
    a, b = list(hostile.kubelets)
    hostile.kube.put("pods", attacker("imgs", a, "images"))
    await hostile.until_steps("imgs", a, 5)
    caps_before = await _caps(hostile, "imgs", a)
    await hostile.core.patch_node(a, {"spec": {"unschedulable": True}})  # leave-running
    assert (await hostile.latest("imgs.main"))["leave_running"]
    gen = await hostile.store.latest("default", "imgs.main")
    assert gen is not None
    for f in gen.manifest["files"]:
        if f["path"].startswith("images/") and f["path"].endswith(".img") and f["size"]:
            data = await _stored(hostile, gen, f["path"])
            assert b"garbage" not in data[:64], f"{f['path']} was edited by the workload"
    before = steps(hostile.log("imgs", a))
    await hostile.drained_to("imgs", a, b, before)  # restores the stored images
    assert await _caps(hostile, "imgs", b) == caps_before


async def test_directory_swapped_for_symlink_copies_nothing_of_the_host(
        hostile: Cluster, tmp_path: Path) -> None:
    """Attack 4: a directory of the layer becomes a symlink to a host
    directory while the layer is read."""
    a, _ = list(hostile.kubelets)
    secret = tmp_path / "host-dir"
    secret.mkdir()
    for i in range(50):
        (secret / f"host-secret-{i}").write_text("host secret\n")
    hostile.kube.put("pods", attacker("swapper", a, "swap", SECRET_DIR=str(secret)))
    await hostile.until_steps("swapper", a, 5)
    for i in range(4):  # the race is tried at each capture
        done = await checkpoint(hostile, "swapper", a, "swapper.main")
        assert done.status == "succeeded", done.error
        gen = await hostile.store.latest("default", "swapper.main")
        assert gen is not None
        names = tarfile.open(fileobj=io.BytesIO(await _stored(hostile, gen, "rootfs.tar"))
                             ).getnames()
        assert not [n for n in names if "host-secret" in n], f"capture {i}: {names}"
        assert "data/born" in names


async def test_dev_shm_links_and_swaps_copy_nothing_of_the_host(
        hostile: Cluster, tmp_path: Path) -> None:
    """The container's /dev/shm, carried with its checkpoint, is the
    tenant's too: a link in it to a host file, and a directory swapped for a
    link to a host directory while it is read."""
    a, _ = list(hostile.kubelets)
    secret = tmp_path / "host-dir"
    secret.mkdir()
    for i in range(50):
        (secret / f"host-secret-{i}").write_text("host secret\n")
    hostile.kube.put("pods", attacker("shm", a, "shm-swap", SECRET_DIR=str(secret)))
    await hostile.until_steps("shm", a, 5)
    for i in range(4):  # the race is tried at each capture
        done = await checkpoint(hostile, "shm", a, "shm.main")
        assert done.status == "succeeded", done.error
        gen = await hostile.store.latest("default", "shm.main")
        assert gen is not None
        with tarfile.open(fileobj=io.BytesIO(await _stored(hostile, gen, "devshm.tar"))) as t:
            members = {m.name: m for m in t.getmembers()}
            assert not [n for n in members if "host-secret" in n], f"capture {i}: {members}"
            assert members["dev/shm/link"].issym(), "a link's target was read"
            for m in members.values():
                f = t.extractfile(m) if m.isreg() else None
                assert f is None or b"host secret" not in f.read(), f"capture {i}: {m.name}"


@pytest.fixture(scope="module")
def criu_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """An image whose files would run code in a CRIU started with its root as
    `/`: a configuration naming an action script, a plugin, a preloaded
    library, an NSS module for every database; and the host marker that code
    would write."""
    d = tmp_path_factory.mktemp("criu-hostile")
    marker = MARKER_DIR / f"smr-attack-{uuid.uuid4().hex[:8]}-criu"
    libs = {}
    for vector in ("plugin", "ld.so.preload", "nss"):
        src = d / "evil.c"
        src.write_text(CRIU_EVIL.replace("VECTOR", f'"{vector}"')
                       .replace("MARKER", f'"{marker}"'))
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", d / "evil.so", src], check=True)
        libs[vector] = (d / "evil.so").read_bytes()
    # CRIU's kernel probes run `sh -c "iptables -n -w -L"` (criu/kerndat.c):
    # the image's sh and iptables, were CRIU to probe with its root as `/`.
    src.write_text(CRIU_EVIL.replace("VECTOR", '"iptables"').replace("MARKER", f'"{marker}"')
                   + "int main(void) { return 0; }\n")
    subprocess.run(["gcc", "-static", "-o", d / "iptables", src], check=True)
    files = {"/bin/counter": COUNTER,
             "/etc/criu/default.conf": b"action-script /bin/criu-action\n",
             "/bin/criu-action": CRIU_ACTION,
             "/usr/lib/criu/evil.so": libs["plugin"],
             "/etc/ld.so.preload": b"/lib/evil-preload.so\n",
             "/lib/evil-preload.so": libs["ld.so.preload"],
             "/etc/nsswitch.conf": b"".join(b"%s: evil\n" % db for db in NSS_DATABASES)}
    for lib in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib"):
        files[f"{lib}/libnss_evil.so.2"] = libs["nss"]
    for bindir in ("/sbin", "/usr/sbin", "/bin", "/usr/bin"):
        files[f"{bindir}/iptables"] = (d / "iptables").read_bytes()
    yield oci_image.build(d / "img.tar", CRIU_IMAGE, files=files), marker
    marker.unlink(missing_ok=True)


@pytest.fixture
async def criu_hostile(cluster: Cluster, criu_image: tuple[Path, Path]
                       ) -> tuple[Cluster, Path]:
    image, marker = criu_image
    for node, kubelet in cluster.kubelets.items():
        await kubelet.ctd.import_image(node, image)
    return cluster, marker


async def test_image_criu_config_plugin_and_preload_never_run_in_criu(
        criu_hostile: tuple[Cluster, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's CRIU never starts with the container's root as `/`: the
    image's /etc/criu/default.conf (an action script), its /usr/lib/criu/
    plugin, its /etc/ld.so.preload, its NSS modules and the programs CRIU's
    kernel probes run (iptables, through sh) run nothing, at a dump or a
    restore. The container's /run/criu.kdat (CRIU's cache of kernel features;
    there, the tenant's file) is neither read, removed nor written: each run
    loads the agent's own cache."""
    cluster, marker = criu_hostile
    a, b = list(cluster.kubelets)
    logs: list[str] = []
    run = Criu._run

    async def logged(self: Criu, args: list[str], *rest: Any, **kw: Any) -> Any:
        done = await run(self, args, *rest, **kw)
        logs.append(done.log.read_text(errors="replace"))
        return done

    monkeypatch.setattr(Criu, "_run", logged)
    p = workload("criuconf", a, image=CRIU_IMAGE, labels={"smr.dev/node-restore": "true"})
    p["spec"]["containers"][0]["command"] = [
        "/smr/smr-init", "--", "/bin/sh", "-c", "echo mine > /run/criu.kdat; exec /bin/counter"]
    cluster.kube.put("pods", p)
    await cluster.until_steps("criuconf", a, 5)

    def ran(where: str, evidence: str) -> None:
        what = [v for v in ("action-script", "plugin", "ld.so.preload", "nss", "iptables")
                if v in evidence]
        if marker.exists():
            what.append(f"a host file written through CRIU's descriptors "
                        f"({marker.read_text().split()})")
        assert not what, f"{where}: the image's code ran in the agent's CRIU: {what}"
        assert logs and all("Loaded kdat cache" in log for log in logs), (
            f"{where}: a CRIU run probed the kernel in the container instead of loading the "
            f"agent's cache: {[log.splitlines()[3:5] for log in logs]}")

    done = await checkpoint(cluster, "criuconf", a, "criuconf.main")
    ran("checkpoint", await _smr_file(cluster, "criuconf", "criu-evidence"))
    assert done.status == "succeeded", done.error
    assert await _run_file(cluster, "criuconf", "criu.kdat") == "mine\n", (
        "CRIU read the container's /run/criu.kdat and removed or rewrote it")

    before = steps(cluster.log("criuconf", a))
    logs.clear()
    await cluster.core.patch_node(a, {"spec": {"unschedulable": True}})
    await cluster.latest("criuconf.main", after=1)
    await cluster.drained_to("criuconf", a, b, before)  # restored on b
    ran("restore", await _smr_file(cluster, "criuconf", "criu-evidence"))
    # A new container's /run: nothing of CRIU's is left in it.
    assert await _run_file(cluster, "criuconf", "criu.kdat") is None, (
        "the restoring CRIU wrote its cache into the container's /run")


# A tenant's own PID 1 named smr-init (a hand-written manifest runs whatever
# the pod names): in a user and mount namespace of its own (unprivileged: the
# container's root owns them) it mounts an overlay whose upperdir option is
# the string $UPPER, a host path, and stands in that overlay's root; its
# workload, forked first, keeps the container's root. It speaks smr-init's
# status protocol, so the agent checkpoints it like any pod.
FAKE_SHIM = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static void die(const char *what) {
    fprintf(stderr, "fake smr-init: %s: %s\n", what, strerror(errno));
    exit(1);
}
static void put(const char *path, const char *s) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || write(fd, s, strlen(s)) < 0) die(path);
    close(fd);
}
static void mkdirs(char *p) {
    for (char *s = p + 1; *s; s++) if (*s == '/') { *s = 0; mkdir(p, 0755); *s = '/'; }
    mkdir(p, 0755);
}

int main(void) {
    const char *upper = getenv("UPPER");
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS)) die("unshare");
    put("/proc/self/setgroups", "deny");
    put("/proc/self/uid_map", "0 0 1");
    put("/proc/self/gid_map", "0 0 1");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) die("private");
    mkdir("/t", 0755);
    if (mount("t", "/t", "tmpfs", 0, NULL)) die("tmpfs");
    mkdir("/t/lower", 0755); mkdir("/t/work", 0755); mkdir("/t/m", 0755);
    char up[4096];
    snprintf(up, sizeof up, "/t%s", upper);
    mkdirs(up);
    int top = open("/", O_PATH | O_DIRECTORY);
    if (chroot("/t") || chdir("/")) die("chroot");
    char opts[8192];
    snprintf(opts, sizeof opts, "lowerdir=/lower,upperdir=%s,workdir=/work", upper);
    if (mount("overlay", "/m", "overlay", 0, opts)) die("overlay");
    /* back to the container's root for the workload */
    if (fchdir(top) || chroot(".")) die("back");
    pid_t w = fork();
    if (w == 0) {  /* stdin again, from this mount namespace's /dev */
        int null = open("/dev/null", O_RDONLY);
        if (null < 0 || dup2(null, 0) < 0) die("stdin");
        close(null);
        setsid();
        execl("/bin/sh", "sh", "/bin/counter", (char *)NULL);
        die("exec counter");
    }
    if (chroot("/t/m") || chdir("/")) die("chroot overlay");
    mkdir("/smr", 0755); mkdir("/smr/main", 0755);
    char line[64];
    snprintf(line, sizeof line, "running %d fresh\n", (int)w);
    put("/smr/main/status", line);
    for (;;) { int st; if (waitpid(-1, &st, 0) == w) return 0; }
}
"""
FAKE_SHIM_IMAGE = "smr.test/fake-shim:1"


@pytest.fixture(scope="module")
def fake_shim_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fake-shim")
    (d / "shim.c").write_text(FAKE_SHIM)
    subprocess.run(["gcc", "-static", "-O1", "-o", d / "smr-init", d / "shim.c"], check=True)
    return oci_image.build(d / "img.tar", FAKE_SHIM_IMAGE,
                           files={"/bin/counter": COUNTER,
                                  "/bin/smr-init": (d / "smr-init").read_bytes()})


async def test_a_shims_own_mounts_never_name_a_host_directory_to_capture(
        cluster: Cluster, fake_shim_image: Path, tmp_path: Path) -> None:
    """The writable layer the agent captures is the container's, whatever
    the process it takes for smr-init mounted in a namespace of its own: a
    host directory named as an overlay's upperdir there is never read."""
    for node, kubelet in cluster.kubelets.items():
        await kubelet.ctd.import_image(node, fake_shim_image)
    a, _ = list(cluster.kubelets)
    secret = tmp_path / "host-dir"
    secret.mkdir()
    for i in range(3):
        (secret / f"host-secret-{i}").write_text("host secret\n")
    p = workload("fakeshim", a, image=FAKE_SHIM_IMAGE, labels={"smr.dev/node-restore": "true"},
                 env={"UPPER": str(secret)})
    p["spec"]["containers"][0]["command"] = ["/bin/smr-init"]
    cluster.kube.put("pods", p)
    await cluster.until_steps("fakeshim", a, 3)
    done = await checkpoint(cluster, "fakeshim", a, "fakeshim.main")
    gen = await cluster.store.latest("default", "fakeshim.main")
    names = [] if gen is None else tarfile.open(
        fileobj=io.BytesIO(await _stored(cluster, gen, "rootfs.tar"))).getnames()
    assert not [n for n in names if "host-secret" in n], \
        f"the host directory {secret} was captured as the pod's layer: {names}"
    assert done.status == "failed" and done.error, done
    assert done.error["code"] == "unsafe-path-in-container", done.error
    assert "mount namespace it made" in done.error["message"], done.error


async def _smr_file(cluster: Cluster, pod: str, name: str) -> str:
    """A file of the pod's running container's /smr, or "" (the host's view)."""
    return await _container_file(cluster, pod, f"smr/{name}") or ""


async def _run_file(cluster: Cluster, pod: str, name: str) -> str | None:
    """A file of the pod's running container's /run, or None."""
    return await _container_file(cluster, pod, f"run/{name}")


async def _container_file(cluster: Cluster, pod: str, path: str) -> str | None:
    from services.containers import host
    from services.containers.pods import runtime_id

    for _ in range(100):
        st = cluster.kube.get("pods", pod, "default")
        if st and (cs := st["status"].get("containerStatuses")) and cs[0].get("containerID"):
            shim = host.find_shim(runtime_id(cs[0]["containerID"]))
            if shim:
                f = Path(f"/proc/{shim.pid}/root") / path
                return f.read_text() if f.exists() else None
        await asyncio.sleep(0.2)
    raise AssertionError(f"no running container of pod {pod}")


async def _stored(cluster: Cluster, gen: Any, path: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "gen"
        await cluster.store.fetch(gen, d, only=lambda p: p == path)
        return (d / path).read_bytes()


async def _caps(cluster: Cluster, pod: str, node: str) -> str:
    """The workload's effective capabilities (from /proc, the host's view)."""
    from services.containers import host
    from services.containers.pods import runtime_id

    st = cluster.kube.get("pods", pod, "default")
    assert st is not None
    for _ in range(100):
        st = cluster.kube.get("pods", pod, "default")
        if st and (cs := st["status"].get("containerStatuses")) and cs[0].get("containerID"):
            shim = host.find_shim(runtime_id(cs[0]["containerID"]))
            if shim and (w := shim.workload()):
                text = Path(f"/proc/{w[0]}/status").read_text()
                return next(ln for ln in text.splitlines() if ln.startswith("CapEff"))
        await asyncio.sleep(0.2)
    raise AssertionError(f"no workload of pod {pod} on {node}")


NESTED_IMAGE = "smr.test/nested-ns:1"


@pytest.fixture(scope="module")
def nested_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("nested-ns")
    links = {f"bin/{a}": "busybox" for a in ("unshare", "mkfifo")}
    return oci_image.build(d / "img.tar", NESTED_IMAGE, links=links,
                           files={"/bin/counter": COUNTER, "/etc/criu/default.conf": b"\n"})


async def test_a_failed_dump_reads_no_criu_config_of_the_image_and_answers(
        cluster: Cluster, nested_image: Path) -> None:
    """A tree CRIU cannot dump (a process in a user and network namespace of
    its own, which any tenant can make) fails its checkpoint with CRIU's own
    reason, at once, and runs on. Explaining the failure never runs CRIU in
    the container without --no-default-config: the image's
    /etc/criu/default.conf, here a FIFO no one writes, would be read as
    CRIU's configuration (and its open would hold the step for ever), and
    the CRIU version a hint quotes is the agent's, not what a tenant's
    configuration makes `criu --version` say."""
    for node, kubelet in cluster.kubelets.items():
        await kubelet.ctd.import_image(node, nested_image)
    a, _ = list(cluster.kubelets)
    p = workload("nested", a, image=NESTED_IMAGE, labels={"smr.dev/node-restore": "true"})
    p["spec"]["containers"][0]["command"] = [
        "/smr/smr-init", "--", "/bin/sh", "-c",
        "rm /etc/criu/default.conf && mkfifo /etc/criu/default.conf || exit 1; "
        "unshare -U -r -n sleep 100000 & exec /bin/counter"]
    cluster.kube.put("pods", p)
    await cluster.until_steps("nested", a, 3)
    try:
        done = await asyncio.wait_for(checkpoint(cluster, "nested", a, "nested.main"), 45)
    except TimeoutError:
        raise AssertionError("the checkpoint of a tree CRIU cannot dump never answered: the "
                             "agent's CRIU opened the image's /etc/criu/default.conf") from None
    assert done.status == "failed" and done.error, done
    assert done.error["code"] == "criu-dump-failed", done.error
    assert "nested user namespace" in done.error["message"], done.error
    assert "cannot checkpoint a process holding" not in (done.error.get("hint") or ""), (
        f"the hint blames a CRIU version the image's configuration made up: {done.error}")
    n = len(steps(cluster.log("nested", a)))
    await cluster.until_steps("nested", a, n + 2)  # and the workload runs on


async def refused_before_criu(cluster: Cluster, pod: str, node: str,
                             criu_runs: list[list[str]],
                             code: str = "container-can-ptrace") -> CkptDone:
    """Checkpoints ``pod``; asserts it was refused (``code``) with CRIU never
    run and the workload running on."""
    done = await checkpoint(cluster, pod, node, f"{pod}.main")
    assert done.status == "failed" and done.error, done
    assert done.error["code"] == code, done.error
    assert not criu_runs, f"CRIU ran in a container that can be ptraced: {criu_runs}"
    n = len(steps(cluster.log(pod, node)))
    await cluster.until_steps(pod, node, n + 3)  # nothing was frozen: it runs on
    return done


@pytest.mark.parametrize("security", [{"capabilities": {"add": ["SYS_PTRACE"]}},
                                      {"privileged": True}], ids=["sys-ptrace", "privileged"])
async def test_a_container_that_can_ptrace_is_refused_before_criu_runs_in_it(
        cluster: Cluster, criu_runs: list[list[str]], security: dict[str, Any]) -> None:
    """CRIU runs in the container's PID namespace as root, holding the
    agent's own directories open. A process there with CAP_SYS_PTRACE could
    read those descriptors (`..` from one walks the host's tree) or take
    CRIU over; without it the kernel denies both. So such a container is
    refused, before anything is frozen, with a reason; CRIU never starts
    there, and the workload runs on."""
    a, _ = list(cluster.kubelets)
    p = workload("tracer", a, labels={"smr.dev/node-restore": "true"})
    p["spec"]["containers"][0]["securityContext"] = security
    cluster.kube.put("pods", p)
    await cluster.until_steps("tracer", a, 3)
    status = await _container_file(cluster, "tracer", "proc/1/status") or ""
    bnd = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("CapBnd:")), 16)
    assert bnd >> 19 & 1, "the container was not given CAP_SYS_PTRACE: the test proves nothing"
    done = await refused_before_criu(cluster, "tracer", a, criu_runs)
    assert "SYS_PTRACE" in done.error["hint"], done.error
    event = await cluster.event("CheckpointFailed", "tracer")
    assert "CAP_SYS_PTRACE" in event["message"], event["message"]


@pytest.mark.parametrize("security", [{"privileged": True},
                                      {"capabilities": {"add": ["CAP_SYS_PTRACE"]}}],
                         ids=["sysadmin-profile", "cap-sys-ptrace"])
async def test_a_ptracer_in_the_pods_spec_not_started_yet_is_refused_before_criu_runs(
        cluster: Cluster, criu_runs: list[list[str]], security: dict[str, Any]) -> None:
    """An ephemeral debug container targeting the container (`kubectl debug
    --target=main --profile=sysadmin` adds one through the pod's
    ephemeralcontainers subresource) is in the pod's spec before the kubelet
    starts it, for as long as its image pulls: no process of it is there to
    look at, and it may start while CRIU runs, in CRIU's PID namespace with
    CAP_SYS_PTRACE. The fake kubelet never starts ephemeral containers, so
    here it stays at that point. The spec decides: refused before anything is
    frozen, CRIU never starts, and the workload runs on."""
    a, _ = list(cluster.kubelets)
    cluster.kube.put("pods", workload("debugged", a, labels={"smr.dev/node-restore": "true"}))
    await cluster.until_steps("debugged", a, 3)
    # What the ephemeralcontainers subresource writes: the pod, one more entry.
    pod = cluster.kube.get("pods", "debugged", "default")
    assert pod is not None
    pod["spec"]["ephemeralContainers"] = [{
        "name": "debugger", "image": "busybox", "targetContainerName": "main",
        "command": ["sh"], "stdin": True, "tty": True, "securityContext": security}]
    cluster.kube.put("pods", pod)
    done = await refused_before_criu(cluster, "debugged", a, criu_runs)
    assert "SYS_PTRACE" in done.error["hint"], done.error
    assert "ephemeral container debugger" in done.error["message"], done.error
