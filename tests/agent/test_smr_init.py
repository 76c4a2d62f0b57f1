"""smr-init as PID 1 (REAL runc through smr-runtime): the container's exit
code is its workload's, also for a restored root that exits before the
agent's decision names it, and a hold left by a crashed agent expires."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent.conftest import runtime_state
from tests.agent.runc_bundle import busybox_bundle


class Running:
    def __init__(self, smr_runtime: Path, top: Path, args: list[str], timeout: str,
                 env: dict[str, str] | None = None) -> None:
        self.runtime, self.root = smr_runtime, top / "runc"
        self.cid = f"i-{uuid.uuid4().hex[:6]}"
        bundle = busybox_bundle(top, args, {"SMR_CONTAINER": "main",
                                            "SMR_INIT_TIMEOUT": timeout, **(env or {})})
        self.proc = subprocess.Popen([str(smr_runtime), "--root", str(self.root), "run",
                                      "--bundle", str(bundle), self.cid],
                                     stderr=subprocess.PIPE, text=True)
        self.smr = runtime_state(smr_runtime.parent) / self.cid / "main"
        self.kept: int | None = None

    def keep(self) -> None:
        """Hold smr-init's directory open: its tmpfs is detached when the
        container ends, and stays readable through this descriptor."""
        for _ in range(3000):
            with contextlib.suppress(OSError):
                self.kept = os.open(self.smr, os.O_PATH | os.O_DIRECTORY)
                return
            time.sleep(0.01)
        raise AssertionError(f"smr-init never made {self.smr}")

    def status(self) -> str:
        try:
            if self.kept is not None:
                fd = os.open("status", os.O_RDONLY, dir_fd=self.kept)
                with os.fdopen(fd) as f:
                    return f.read()
            return (self.smr / "status").read_text()
        except OSError:
            return ""

    def until_status(self, word: str) -> None:
        for _ in range(300):
            if self.status().startswith(word):
                return
            time.sleep(0.1)
        raise AssertionError(f"smr-init never said {word!r}: {self.status()!r}")

    def pid(self) -> int:
        out = subprocess.run(["runc", "--root", str(self.root), "state", self.cid],
                             capture_output=True, text=True, check=True).stdout
        return int(json.loads(out)["pid"])

    def decide(self, decision: str) -> None:
        (self.smr / "decision.tmp").write_text(decision + "\n")
        (self.smr / "decision.tmp").rename(self.smr / "decision")

    def stop(self) -> None:
        if self.kept is not None:
            os.close(self.kept)
        if self.proc.poll() is None:
            subprocess.run(["runc", "--root", str(self.root), "kill", self.cid, "KILL"],
                           check=False, capture_output=True)
            self.proc.wait(30)


@pytest.fixture
def top(request: pytest.FixtureRequest) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="smr-init-") as d:
        yield Path(d)


def test_a_restored_root_that_exits_before_the_decision_gives_its_exit_code(
        smr_runtime: Path, top: Path) -> None:
    """CRIU restores detached: the restored root is reparented to smr-init
    and may exit before the agent writes `restored PID`. Here that root is
    a process started in the container's PID namespace and orphaned there
    (as CRIU leaves it), exiting 3 before the decision."""
    c = Running(smr_runtime, top, ["/bin/sh", "-c", "exit 9"], "60")
    try:
        c.until_status("waiting")
        shim = c.pid()
        out = subprocess.run(
            ["nsenter", "-t", str(shim), "-p", "-m", "--", "/bin/sh", "-c",
             # It outlives the shell that started it (a shell may reap a child
             # that ends first: then smr-init never sees it, unlike CRIU's root).
             '/bin/sh -c "sleep 0.5; exit 3" & echo $!'], capture_output=True, text=True,
            check=True)
        root = int(out.stdout.strip())
        # Reparented to smr-init, then reaped by it while it waits.
        for _ in range(300):
            kids = [k for t in Path(f"/proc/{shim}/task").iterdir()
                    for k in (t / "children").read_text().split()]
            if not kids:
                break
            time.sleep(0.1)
        c.decide(f"restored {root}")
        assert c.proc.wait(30) == 3, "the restored root's exit code was lost"
    finally:
        c.stop()


def test_a_stale_hold_expires_and_a_fresh_one_holds(smr_runtime: Path, top: Path) -> None:
    c = Running(smr_runtime, top, ["/bin/sh", "-c", "sleep 1; exit 5"], "0.1")
    try:
        c.until_status("running")
        hold = c.smr / "hold"
        hold.write_text("")
        c.until_status("exited")
        assert c.proc.poll() is None, "a fresh hold keeps the container"
        # The agent crashed: nobody touches the hold any more.
        old = time.time() - 120
        os.utime(hold, (old, old))
        assert c.proc.wait(30) == 5, "a stale hold kept the container"
    finally:
        c.stop()


@pytest.mark.parametrize("policy", ["fail", "fresh"])
def test_no_answer_from_the_agent_follows_the_restore_failure_policy(
        smr_runtime: Path, top: Path, policy: str) -> None:
    """No agent answers (none runs, or none of its pods claims the
    container): at its start timeout smr-init starts the command fresh only
    where the pod's policy allows it (SMR_RESTORE_FAILURE, which the webhook
    sets from the label smr.dev/restore-failure); `fail` exits 70."""
    marker = top / "bundle" / "rootfs" / "started"
    c = Running(smr_runtime, top, ["/bin/sh", "-c", "touch /started; exit 4"], "1",
                {"SMR_RESTORE_FAILURE": policy})
    try:
        c.keep()
        code = c.proc.wait(30)
        err = c.proc.stderr.read() if c.proc.stderr else ""
        if policy == "fail":
            assert code == 70 and not marker.exists(), \
                f"exit {code}, command ran: {marker.exists()}; smr-init said: {err}"
            assert "forbids a fresh start" in err, err
            assert c.status().startswith("failed")
        else:
            assert code == 4 and marker.exists(), f"exit {code}; smr-init said: {err}"
    finally:
        c.stop()


URING = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    char params[120] = {0};
    long fd = syscall(425, 8, params); /* io_uring_setup */
    if (fd < 0) printf("errno %d\n", errno); else printf("fd %ld\n", fd);
    return 0;
}
"""


@pytest.mark.parametrize("allow", [False, True], ids=["default", "opted-out"])
def test_io_uring_setup_fails_with_enosys_in_the_workloads_tree(
        smr_runtime: Path, top: Path, allow: bool) -> None:
    """A grandchild of smr-init's workload (a shell's child) calling
    io_uring_setup gets ENOSYS, as libuv needs to fall back to epoll; with
    SMR_IO_URING=allow in the container's environment it gets its ring."""
    src = top / "uring.c"
    src.write_text(URING)
    binary = top / "bundle" / "rootfs" / "opt" / "uring"
    binary.parent.mkdir(parents=True)
    subprocess.run(["gcc", "-static", "-O2", "-o", str(binary), str(src)], check=True)
    env = {"SMR_RESTORE_FAILURE": "fresh", **({"SMR_IO_URING": "allow"} if allow else {})}
    c = Running(smr_runtime, top, ["/bin/sh", "-c", "/opt/uring > /result; exit 0"], "0.2",
                env)
    try:
        assert c.proc.wait(30) == 0
        said = (top / "bundle" / "rootfs" / "result").read_text().strip()
        if allow:
            assert said.startswith("fd "), said
        else:
            assert said == "errno 38", f"io_uring_setup under smr-init: {said}"  # ENOSYS
    finally:
        c.stop()


def test_a_restored_root_that_exits_before_the_decision_among_many_orphans_gives_its_code(
        smr_runtime: Path, top: Path) -> None:
    """As above, but the root's tree leaves more than 64 orphans that end
    before the decision too (a tree winding down while the agent finishes)."""
    c = Running(smr_runtime, top, ["/bin/sh", "-c", "exit 9"], "60")
    try:
        c.until_status("waiting")
        shim = c.pid()
        out = subprocess.run(
            ["nsenter", "-t", str(shim), "-p", "-m", "--", "/bin/sh", "-c",
             '/bin/sh -c "sleep 0.3; exit 3" & echo $!; '
             'i=0; while [ $i -lt 70 ]; do /bin/sh -c "sleep 1.5" & i=$((i+1)); done'],
            capture_output=True, text=True, check=True)
        root = int(out.stdout.split()[0])
        for _ in range(300):
            kids = [k for t in Path(f"/proc/{shim}/task").iterdir()
                    for k in (t / "children").read_text().split()]
            if not kids:
                break
            time.sleep(0.1)
        c.decide(f"restored {root}")
        assert c.proc.wait(30) == 3, "the restored root's exit code was lost"
    finally:
        c.stop()
