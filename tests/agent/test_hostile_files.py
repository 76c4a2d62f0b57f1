"""The hostile-file matrix: for every path of the inventory
(services/containers/inventory) that a tenant can plant, each kind of hostile
file is planted there and the real step that touches the path is run.
Nothing may happen outside the container (a host file reached by a link is
neither opened, read nor written; a planted device or FIFO is never opened;
a 1 TiB sparse file costs the node's disk nothing), and the step either goes
on or fails with a clear code (an SmrError's code, never a bare OSError).

Where it runs: one real runc container (busybox `sleep` as PID 1, its own
mount and PID namespaces) carries every plant in turn; the step is the real
function the agent calls (Shim.status/hold/decide/restored/final,
prestop._waiting, rootfs.capture/capture_shm/saved_bytes/apply,
checkpointer.pod_dump._note_link_names/_drop_link_remaps,
restorer.pod._point_link_names, gpus._check_node) on that container's PID.
The pod path adds nothing there: the step finds the container's smr-init by
its cgroup and calls these same functions with its PID (the layer's upperdir
is found in smr-init's mountinfo; here the container's root directory stands
for it). /dev/shm has no mount of its own here and /dev (runc's tmpfs) is
not nodev, so a device planted there would really open: the check sees any
open. The code-loading plants (a CRIU config, plugin, ld.so.preload, NSS
module) need the agent's real CRIU in a pod: they run through the agent
harness (real containerd, runc, CRIU), one pod for all four.

Every path the agent opens through the container's root while a step runs is
recorded and must match an inventory entry (a new path comes with its row).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from services.agent import prestop
from services.checkpointer import pod_dump as ckpt_pod
from services.containers import confined, gpus, inventory, rootfs
from services.containers.host import Shim
from services.restorer import pod as restore_pod
from smr.contract.errors import SmrError
from tests.agent.cluster import Cluster, workload
from tests.agent.opens import Opens
from tests.agent.runc_bundle import busybox_bundle
from tests.agent.test_attacks import (  # the image and its fixtures, shared
    CRIU_IMAGE,
    _smr_file,
    checkpoint,
    criu_image,  # noqa: F401 (a fixture of criu_hostile)
)
from tests.agent.test_attacks import criu_hostile as _criu_hostile

criu_hostile = _criu_hostile  # a fixture, shared

KINDS = ("symlink", "fifo", "chardev", "blockdev", "sparse-1TiB", "hardlink-outside",
         "directory")
NAMES = "names-100MB"
CODE = ("criu-config", "criu-plugin", "ld.so.preload", "nss-module")
TIB = 1 << 40
NAME_BYTES = 100 << 20
# A hard link crosses no file system: /dev (runc's tmpfs, with /dev/shm and
# /dev/nvidia* on it) holds no file from outside the container to link to.
# And the layer is an overlay upperdir: overlayfs copies a file up before it
# links it, so every name of an upper file is in the upperdir.
NO_HARDLINK = {"dev-shm", "dev-shm-file", "link-remap", "gpu-node", "layer"}
# Where each plantable entry's file is, in the container (the layer: in its
# root directory, standing for the upperdir).
WHERE = {"status": "/smr/main/status", "signal.lock": "/smr/main/signal.lock",
         "signalled": "/smr/main/signalled", "hold": "/smr/main/hold",
         "decision": "/smr/main/decision", "decision.tmp": "/smr/main/.decision.smr-tmp",
         "restored": "/smr/main/restored", "final": "/smr/main/final",
         "waiter": "/smr/main/waiter", "unanswered": "/smr/main/unanswered",
         "smr-dir": "/smr/main", "dev-shm": "/dev/shm",
         "dev-shm-file": "/dev/shm/f", "link-remap": "/dev/shm/link_remap.1",
         "layer": "/data/f", "restore-target": "/data/f", "gpu-node": "/dev/nvidia0"}
# The codes a step may fail with: each names what it refused.
CODES = {"unsafe-path-in-container", "capture-too-large", "shim-busy",
         "gpu-not-granted", "rootfs-restore-failed", "link-remap-unsupported"}
BUDGET = 64 << 20  # the capture's cap here (SMR_CAPTURE_BYTES stands for it)


def cases() -> list[tuple[str, str]]:
    out = []
    for e in inventory.ENTRIES:
        if e.plant and e.key in WHERE:
            out += [(e.key, k) for k in KINDS if not (k == "hardlink-outside"
                                                      and e.key in NO_HARDLINK)]
        if e.names:
            out.append((e.key, NAMES))
        if e.runs:
            out += [(e.key, k) for k in CODE]
    return out


CASES = cases()


def test_the_matrix_covers_every_plantable_entry(capsys: pytest.CaptureFixture[str]) -> None:
    """Every entry a tenant can plant has its place here (a new entry needs
    one, and a step), and the count is printed for CI."""
    plantable = {e.key for e in inventory.ENTRIES if e.plant}
    assert plantable <= set(WHERE) | {"criu-in-container"}, plantable - set(WHERE)
    assert set(WHERE) <= set(STEPS), set(WHERE) - set(STEPS)
    paths = {k for k, _ in CASES}
    kinds = {k for _, k in CASES}
    with capsys.disabled():  # in CI's output, captured or not
        print(f"\nhostile-file matrix: {len(paths)} paths x {len(kinds)} kinds = "
              f"{len(CASES)} cases (each path with the kinds that apply to it; hard links "
              f"left out where no file outside shares the file system: "
              f"{sorted(NO_HARDLINK)})")


@dataclass
class Box:
    """The container and the host's files a hostile plant points at."""

    pid: int
    root: Path  # the container's root directory on the host (bundle/rootfs)
    host: Path  # a host file: a symlink's and a hard link's target
    work: Path  # the agent's work directory for captures
    tar: Path  # a layer saved from a clean container (data/f), for the restore
    budget: int = BUDGET

    def inside(self, path: str) -> Path:
        return Path(f"/proc/{self.pid}/root") / path.lstrip("/")

    @property
    def shim(self) -> Shim:
        return Shim(self.pid, "/smr", "main")


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    top = Path(tempfile.mkdtemp(prefix="smr-matrix-"))
    bundle = busybox_bundle(top, ["/bin/sleep", "100000"], {})
    spec = json.loads((bundle / "config.json").read_text())
    # /dev/shm a directory of runc's /dev (not nodev), so the matrix can
    # replace it and a planted device there would really open.
    spec["mounts"] = [m for m in spec["mounts"] if m["destination"] != "/dev/shm"]
    (bundle / "config.json").write_text(json.dumps(spec))
    runc_root, cid = top / "runc", f"matrix-{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen(["runc", "--root", str(runc_root), "run", "--bundle", str(bundle),
                             cid], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        pid = 0
        for _ in range(300):
            r = subprocess.run(["runc", "--root", str(runc_root), "state", cid],
                               capture_output=True, text=True)
            if r.returncode == 0 and json.loads(r.stdout)["status"] == "running":
                pid = json.loads(r.stdout)["pid"]
                break
            time.sleep(0.1)
        assert pid, "the matrix's container never ran"
        host = top / "host-secret"
        clean = top / "clean"
        (clean / "data").mkdir(parents=True)
        (clean / "data/f").write_text("layer\n")
        work = top / "work"
        work.mkdir()
        tar = top / "clean.tar"
        asyncio.run(rootfs.capture(clean, tar, rootfs.Budget(BUDGET, "test")))
        yield Box(pid, bundle / "rootfs", host, work, tar)
    finally:
        if os.path.ismount(top / "bundle/rootfs/data"):
            subprocess.run(["umount", str(top / "bundle/rootfs/data")])
        subprocess.run(["runc", "--root", str(runc_root), "kill", cid, "KILL"],
                       capture_output=True)
        proc.wait(timeout=30)
        subprocess.run(["runc", "--root", str(runc_root), "delete", "-f", cid],
                       capture_output=True)
        shutil.rmtree(top, ignore_errors=True)


def _reset(box: Box) -> None:
    """smr's files as smr-init leaves them, /dev/shm and the layer plain."""
    box.budget = BUDGET
    if os.path.ismount(box.root / "data"):
        subprocess.run(["umount", str(box.root / "data")], check=True)
    for p in ("/smr/main", "/dev/shm", "/data", "/dev/nvidia0"):
        _remove(box.inside(p))
    main = box.inside("/smr/main")
    main.mkdir(parents=True)
    (main / "status").write_text("running 1 fresh\n")
    (main / "waiter").write_text("")
    box.inside("/dev/shm").mkdir()
    (box.inside("/dev/shm") / "f").write_text("shm\n")
    box.inside("/data").mkdir()
    box.inside("/data/f").write_text("mine\n")
    box.host.write_text("host secret\n")
    os.utime(box.host, (1_000_000_000, 1_000_000_000))
    for f in box.work.iterdir():
        _remove(f)


def _remove(p: Path) -> None:
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def _plant(box: Box, where: str, kind: str) -> list[Path]:
    """Put ``kind`` at ``where`` in the container; the nodes that must never
    be opened."""
    p = box.inside(where)
    _remove(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    if kind == "symlink":
        p.symlink_to(box.host)
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "chardev":
        os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null: harmless if opened
    elif kind == "blockdev":
        os.mknod(p, 0o666 | stat.S_IFBLK, os.makedev(7, 0))  # a loop device
    elif kind == "sparse-1TiB":
        with open(p, "wb") as f:
            f.truncate(TIB)
    elif kind == "hardlink-outside":
        # From the host's side of the container's root (the same file
        # system as the host file; the container's mount of it is another).
        os.link(box.host, box.root / where.lstrip("/"))
    elif kind == "directory":
        p.mkdir()
        (p / "x").write_text("a file in the planted directory\n")
    elif kind == NAMES:
        if where.startswith("/data"):
            # A tmpfs for the names (an upperdir on ext4 takes minutes to
            # fill): fwalk and the capture cross into it as into any directory.
            p.mkdir(exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "matrix-names",
                            str(box.root / "data")], check=True)
        _names(p)
        # The capture's cap, small: the names count against it, and its
        # refusal (capture-too-large) comes after a few thousand of them.
        box.budget = 1 << 20
        return []
    return [p] if kind in ("fifo", "chardev", "blockdev") else []


def _names(p: Path) -> None:
    """100 MB of names: hard links of 255-byte names in one directory (a few
    files: a file system caps one file's links)."""
    if not p.is_dir():
        _remove(p)
        p.mkdir()
    n, made = 0, 0
    src = None
    while made < NAME_BYTES:
        if n % 60_000 == 0:
            src = p / f"s{n}"
            src.write_text("")
        name = f"{n:0>12}".ljust(255, "n")
        os.link(src, p / name)  # type: ignore[arg-type]
        made += len(name)
        n += 1


def _disk(p: Path) -> int:
    """Bytes allocated under ``p`` (its blocks, not its apparent size)."""
    total = 0
    for d, _, files in os.walk(p):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
    return total


# -- the steps ----------------------------------------------------------------------------

def _shim_ops(box: Box) -> None:
    """What the scan, a checkpoint, a restore and a final checkpoint do with
    smr-init's files, in their order (services/checkpointer/pod.py: the hold
    is refreshed, with errors left to the step, and let go only once taken)."""
    shim = box.shim
    _coded(shim.status)
    _coded(shim.workload)
    shim.unanswered()  # a bool, never an error: a planted node is never opened
    if _coded(lambda: shim.hold(True)):
        with contextlib.suppress(OSError, SmrError):  # as _keep_holding does
            shim.refresh_hold()
        _coded(lambda: shim.hold(False))
    for op in (lambda: shim.decide("fresh"), lambda: shim.restored(b"note\n"),
               lambda: shim.restored(None), lambda: shim.final("done 1")):
        _coded(op)


def _coded(op: Callable[[], Any]) -> bool:
    """Run one step: it goes on (True), or fails with a code of CODES."""
    try:
        op()
        return True
    except SmrError as e:
        assert e.code in CODES, f"failed with an unexpected code {e.code}: {e}"
        return False
    except Exception as e:
        raise AssertionError(f"failed with {type(e).__name__} and no code: {e}") from e


def _waiting(box: Box, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prestop.host, "shims", lambda max_age=0.0: [box.shim])
    _coded(prestop._waiting)


def _capture_shm(box: Box) -> None:
    _coded(lambda: asyncio.run(rootfs.capture_shm(box.pid, box.work / rootfs.SHM_TAR,
                                                  rootfs.Budget(box.budget, "test"))))
    _coded(lambda: rootfs.saved_bytes(None, box.pid, box.budget))


def _capture_layer(box: Box) -> None:
    _coded(lambda: asyncio.run(rootfs.capture(box.root, box.work / rootfs.TAR,
                                              rootfs.Budget(box.budget, "test"))))
    _coded(lambda: rootfs.saved_bytes(box.root, box.pid, box.budget))


def _link_remaps(box: Box) -> None:
    remaps = [("/dev/shm/link_remap.1", "/dev/shm/sem.x")]
    _coded(lambda: ckpt_pod._note_link_names(box.pid, remaps, box.work))
    records = box.work / "records.json"
    records.write_bytes(orjson.dumps([{"link": "link_remap.1", "uid": 0,
                                       "names": ["sem.x"]}]))
    _coded(lambda: restore_pod._point_link_names(box.pid, records))
    _coded(lambda: ckpt_pod._drop_link_remaps(box.pid, remaps))


def _restore(box: Box) -> None:
    _coded(lambda: asyncio.run(rootfs.apply(box.tar, box.pid)))


def _gpu(box: Box) -> None:
    _coded(lambda: gpus._check_node(box.pid, {"minor": 0, "uuid": "GPU-matrix"}))


STEPS: dict[str, Callable[..., None]] = {
    **{k: _shim_ops for k in ("status", "signal.lock", "signalled", "hold", "decision",
                              "decision.tmp", "restored", "final", "smr-dir",
                              "unanswered")},
    "waiter": _waiting, "dev-shm": lambda b: (_capture_shm(b), _link_remaps(b)),
    "dev-shm-file": _capture_shm, "link-remap": _link_remaps, "layer": _capture_layer,
    "restore-target": _restore, "gpu-node": _gpu}


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path opened through a container's root."""
    paths: list[str] = []
    real = confined._openat2

    def spy(dirfd: int, path: str, flags: int, mode: int) -> int:
        paths.append(path)
        return real(dirfd, path, flags, mode)

    monkeypatch.setattr(confined, "_openat2", spy)
    return paths


@pytest.mark.parametrize(("entry", "kind"), [c for c in CASES if c[1] not in CODE],
                         ids=[f"{e}-{k}" for e, k in CASES if k not in CODE])
def test_hostile_file(box: Box, entry: str, kind: str, recorded: list[str],
                      monkeypatch: pytest.MonkeyPatch) -> None:
    _reset(box)
    nodes = _plant(box, WHERE[entry], kind)
    host_before = (box.host.read_text(), os.stat(box.host).st_mtime_ns)
    opens = Opens()
    try:
        for p in [box.host, *nodes]:
            opens.watch(str(p))
        step = STEPS[entry]
        if step is _waiting:
            step(box, monkeypatch)
        else:
            step(box)
        got = opens.opened()
    finally:
        opens.close()
    assert not got, f"the agent opened, outside the container or a planted node: {got}"
    assert (box.host.read_text(), os.stat(box.host).st_mtime_ns) == host_before, \
        "a host file was written"
    assert _disk(box.work) < 16 << 20, f"the work directory holds {_disk(box.work)} bytes"
    unlisted = sorted({p for p in recorded if not [
        e for e in inventory.matches(p) if e.key != "restore-target"
        or entry == "restore-target"]})
    assert not unlisted, f"paths opened in the container with no inventory entry: {unlisted}"


# -- the code-loading plants: the agent's real CRIU, in a pod ----------------------------

EVIDENCE = {"criu-config": "action-script", "criu-plugin": "plugin",
            "ld.so.preload": "ld.so.preload", "nss-module": "nss"}


@pytest.mark.parametrize(("entry", "kind"), [c for c in CASES if c[1] in CODE],
                         ids=[f"{e}-{k}" for e, k in CASES if k in CODE])
async def test_code_loading_file(criu_hostile: tuple[Cluster, Path], entry: str,
                                 kind: str) -> None:
    """The image carries all four (tests/agent/test_attacks.py's image): a
    CRIU config naming an action script, a plugin in /usr/lib/criu, an
    /etc/ld.so.preload library and an NSS module for every database. A
    leave-running checkpoint runs the agent's CRIU in the pod's container;
    the planted ``kind`` must have run nothing (no evidence in the
    container's /smr, no host marker), and the checkpoint goes on."""
    cluster, marker = criu_hostile
    node = next(iter(cluster.kubelets))
    name = f"m-{uuid.uuid4().hex[:6]}"
    p = workload(name, node, image=CRIU_IMAGE, labels={"smr.dev/node-restore": "true"})
    p["spec"]["containers"][0]["command"] = ["/smr/smr-init", "--", "/bin/counter"]
    cluster.kube.put("pods", p)
    await cluster.until_steps(name, node, 3)
    done = await checkpoint(cluster, name, node, f"{name}.main")
    evidence = await _smr_file(cluster, name, "criu-evidence")
    host = marker.read_text().split() if marker.exists() else []
    assert EVIDENCE[kind] not in evidence, f"{kind} ran in the agent's CRIU: {evidence!r}"
    assert EVIDENCE[kind] not in host, f"{kind} wrote on the host: {host}"
    assert done.status == "succeeded", done.error
