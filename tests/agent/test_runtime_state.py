"""The container's /smr under smr-runtime (REAL runc): a tmpfs of its own,
bounded, never the host's /run; removed on delete by descriptors, so that a
process still holding the directory cannot turn the removal onto host files."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.runc_bundle import busybox_bundle

# Flips DIR/dI with DIR/lI, a symlink to VICTIM (renameat2 RENAME_EXCHANGE),
# for I in 0..K-1, round and round, until DIR is gone: a sidecar sharing the
# pod's PID namespace can do this through /proc/<pid>/root/smr.
RACER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/fs.h>
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    int dfd = open(argv[1], O_RDONLY | O_DIRECTORY), k = atoi(argv[3]);
    char a[32], b[32];
    for (int i = 0; i < k; i++) { snprintf(b, sizeof b, "l%d", i); symlinkat(argv[2], dfd, b); }
    for (long n = 0; n < 100000000; n++) {
        snprintf(a, sizeof a, "d%ld", n % k); snprintf(b, sizeof b, "l%ld", n % k);
        if (syscall(SYS_renameat2, dfd, a, dfd, b, RENAME_EXCHANGE) != 0
            && faccessat(dfd, ".", F_OK, 0) != 0)
            return 0;
    }
    return 0;
}
"""


def _node_bin(smr_runtime: Path, where: Path, **settings: str) -> Path:
    """A copy of smr-runtime with its own settings (smr-runtime.env)."""
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy2(smr_runtime, where / "smr-runtime")
    base = dict(line.split("=", 1) for line in
                (smr_runtime.parent / "smr-runtime.env").read_text().splitlines() if "=" in line)
    base.update(settings)
    (where / "smr-runtime.env").write_text("".join(f"{k}={v}\n" for k, v in base.items()))
    return where / "smr-runtime"


@pytest.fixture
def host_run() -> Iterator[Path]:
    """A small tmpfs standing for the host's /run (shared with containerd
    and systemd on a node), so that what a container puts there is measured
    exactly."""
    d = Path(tempfile.mkdtemp(prefix="smr-host-run-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "host-run", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        shutil.rmtree(d, ignore_errors=True)


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _mounted_at(path: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(path) for line in f)


def test_a_workload_filling_smr_gets_enospc_and_the_hosts_run_does_not_grow(
        smr_runtime: Path, host_run: Path) -> None:
    top = Path(tempfile.mkdtemp(prefix="smr-fill-"))
    try:
        state = host_run / "smr" / "containers"
        runtime = _node_bin(smr_runtime, top / "node-bin", STATE=str(state), SIZE="1m")
        # 16 MiB into /smr, then it waits for the test to look at the host
        # (and makes room again: smr-init writes its status there).
        script = ("busybox dd if=/dev/zero of=/smr/fill bs=64k count=256 2>&1 | busybox head -1; "
                  "busybox grep ' /smr ' /proc/self/mountinfo; busybox touch /smr/filled; "
                  "for i in $(busybox seq 300); do [ -e /smr/go ] && exit 4; sleep 0.1; done; "
                  "exit 9")
        bundle = busybox_bundle(top, ["/bin/sh", "-c", script],
                                {"SMR_CONTAINER": "main", "SMR_INIT_TIMEOUT": "0.2"},
                                user=(1000, 1000))
        cid = f"fill-{uuid.uuid4().hex[:6]}"
        before = _used(host_run)
        proc = subprocess.Popen([str(runtime), "--root", str(top / "runc"), "run", "--bundle",
                                 str(bundle), cid], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            here = state / cid
            for _ in range(300):
                if (here / "filled").exists() or proc.poll() is not None:
                    break
                time.sleep(0.1)
            grown = _used(host_run) - before
            (here / "fill").unlink(missing_ok=True)
            (here / "go").touch()
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                subprocess.run(["runc", "--root", str(top / "runc"), "kill", cid, "KILL"],
                               check=False, capture_output=True)
                proc.wait(30)
        assert proc.returncode == 4, out
        assert "No space left on device" in out, f"/smr took 16 MiB: {out}"
        assert grown < 512 << 10, f"the host's /run grew by {grown} bytes: {out}"
        line = next(x for x in out.splitlines() if " /smr " in x)
        assert " - tmpfs " in line and all(o in line.split()[5].split(",")
                                           for o in ("nodev", "nosuid", "noexec")), line
        # Unmounted and removed when the container went.
        assert not here.exists() and not _mounted_at(here), "its /smr stays on the host"
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_delete_never_follows_a_directory_swapped_for_a_symlink(
        smr_runtime: Path, tmp_path: Path) -> None:
    """The real smr-runtime's delete (the real runtime here: /bin/true),
    raced by a process that flips each subdirectory of the container's state
    with a symlink to a host directory while it is removed."""
    racer = tmp_path / "racer"
    (tmp_path / "racer.c").write_text(RACER)
    subprocess.run(["gcc", "-O2", "-o", str(racer), str(tmp_path / "racer.c")], check=True)
    state = tmp_path / "state"
    state.mkdir()
    runtime = _node_bin(smr_runtime, tmp_path / "node-bin", RUNTIME="/bin/true",
                        STATE=str(state))
    victim = tmp_path / "host-dir"
    subdirs, files = 50, [f"host-file-{i}" for i in range(20)]
    deadline = time.monotonic() + 90  # a bound on the test, not a measure
    tries = left = 0
    while tries < 100 and time.monotonic() < deadline:
        tries += 1
        victim.mkdir(exist_ok=True)
        for f in files:
            (victim / f).write_text("host\n")
        cid = f"c{tries}"
        for j in range(subdirs):
            (state / cid / f"d{j}").mkdir(parents=True)
            for i in range(4):
                (state / cid / f"d{j}" / f"f{i}").touch()
        r = subprocess.Popen([str(racer), str(state / cid), str(victim), str(subdirs)])
        try:
            subprocess.run([str(runtime), "delete", cid], check=True, timeout=60)
        finally:
            r.kill()
            r.wait()
        lost = [f for f in files if not (victim / f).exists()]
        assert not lost, f"try {tries}: delete removed {len(lost)} host files through a link"
        if (state / cid).exists():
            # The racer may make an entry after the walk and before the last
            # rmdir; with the racer gone, the next delete removes the rest.
            left += 1
            subprocess.run([str(runtime), "delete", cid], check=True, timeout=60)
            assert not (state / cid).exists(), (
                f"try {tries}: a second delete, unraced, left the container's state behind")
            lost = [f for f in files if not (victim / f).exists()]
            assert not lost, f"try {tries}: delete removed {len(lost)} host files through a link"
    print(f"\n{left} of {tries} raced deletes left entries the racer made meanwhile")
