"""Which processes the node agent takes for a container's smr-init: PID 1 of
a PID namespace the runtime made, never one a workload nests below it.

A workload that may `unshare` (Kubernetes' default seccomp profile is
Unconfined) makes PID namespaces of its own without privilege; PID 1 of such
a namespace, named smr-init, would otherwise be scanned, answered and taken
for its container's shim, with its own root, status and parent (whose
working directory is where the agent looks for the runtime's bundle).
Real namespaces (util-linux unshare), no container needed.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.containers import host
from tests.test_procfs import BIG_AREA, MiB, read_by


@pytest.fixture
def named_smr_init(tmp_path: Path) -> Path:
    link = tmp_path / host.SHIM_NAME
    link.symlink_to("/bin/sleep")  # argv[0] ends in smr-init, as the agent checks
    return link


def _shims_under(argv: list[str]) -> list[int]:
    """Run ``argv``; once its smr-init runs, the agent's shims among its descendants."""
    p = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            mine = [q for q in host.all_pids() if p.pid in _ancestors(q)]
            if any(_argv0(q).endswith(host.SHIM_NAME) for q in mine):
                return [s.pid for s in host.shims() if s.pid in mine]
            time.sleep(0.05)
        raise AssertionError(f"{argv} never ran smr-init")
    finally:
        p.kill()
        p.wait()


def _argv0(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
    except OSError:
        return ""


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        out.append(pid)
    return out


def test_pid_1_of_a_namespace_nested_in_a_container_is_not_a_shim(named_smr_init: Path
                                                                    ) -> None:
    once = ["unshare", "--pid", "--fork", "--kill-child"]
    # PID 1 of a namespace of the host's: a container's smr-init, as runc starts it.
    assert _shims_under([*once, str(named_smr_init), "30"]), \
        "PID 1 of a container's PID namespace named smr-init was not taken for a shim"
    # PID 1 of a namespace inside that one: what a workload can make.
    nested = _shims_under([*once, *once, str(named_smr_init), "30"])
    assert not nested, (f"PID 1 of a PID namespace nested in a container was taken for its "
                        f"smr-init: pid {nested}")


def test_a_shared_scan_returns_no_shim_that_ended_since(named_smr_init: Path) -> None:
    """The agent's loops share a scan up to host.SCAN_MAX_AGE_S old: a shim
    that scan found and that has ended since (its PID free for another
    process) is not handed out from it."""
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child",
                          str(named_smr_init), "30"])
    try:
        deadline = time.monotonic() + 10
        while not (mine := [s.pid for s in host.shims() if p.pid in _ancestors(s.pid)]):
            assert time.monotonic() < deadline, "its smr-init never ran"
            time.sleep(0.05)
    finally:
        p.kill()
        p.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{mine[0]}/cmdline").exists() and \
            Path(f"/proc/{mine[0]}/cmdline").read_bytes():
        assert time.monotonic() < deadline, f"smr-init {mine[0]} outlived its namespace"
        time.sleep(0.05)
    assert mine[0] not in [s.pid for s in host.shims(max_age=3600)], \
        "a shim that ended was handed out from the shared scan"


# A tenant's process whose argument area (up to 6 MiB: execve's cap, with a
# large RLIMIT_STACK) has no NUL but its last byte: /proc/<pid>/cmdline is
# then one argv[0] of that length (written through /proc/self/mem, no
# privilege needed).
_NUL_LESS_ARGV = r'''
import sys, time
f = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
start, end = int(f[45]), int(f[46])  # arg_start, arg_end
with open("/proc/self/mem", "r+b", buffering=0) as m:
    m.seek(start)
    raw = m.read(end - start)
    m.seek(start)
    m.write(raw[:-1].replace(b"\0", b"x") + raw[-1:])
print(end - start, flush=True)
time.sleep(600)
'''


def test_a_tenants_long_argv0_costs_the_scan_a_bounded_read() -> None:
    """Every process of the host is looked at in each scan (is_shim, several
    times a second): a tenant's process with a 6 MiB argv[0] must cost the
    scan no more than reading its cmdline whole, never time quadratic in
    its length."""
    import resource
    import sys

    def big_stack() -> None:
        hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
        want = 64 << 20
        resource.setrlimit(resource.RLIMIT_STACK, (
            want if hard == resource.RLIM_INFINITY else min(want, hard), hard))

    p = subprocess.Popen([sys.executable, "-c", _NUL_LESS_ARGV] + ["a" * 131071] * 46,
                         stdout=subprocess.PIPE, text=True, preexec_fn=big_stack)
    try:
        assert p.stdout is not None
        size = int(p.stdout.readline())
        assert size > 1 << 20, f"only {size} bytes of arguments"

        read = read_by(lambda: host.is_shim(p.pid))
        assert not host.is_shim(p.pid)
        assert read < 256 << 10, (
            f"is_shim on one tenant process with a {size}-byte argv[0] read {read} bytes")
    finally:
        p.kill()
        p.wait()


def test_a_shim_that_execs_again_is_read_again(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """What the agent keeps of a shim between scans (its SMR_CONTAINER) is
    read again in time: a PID 1 named smr-init that execs smr-init again with
    another SMR_CONTAINER is looked at with the new one, as its own getenv()
    sees it, once the agent reads again (FIXED_REREAD_S, shortened here)."""
    import os
    import signal
    import sys

    from smr.process.tree import process_tree

    link = tmp_path / host.SHIM_NAME
    link.symlink_to(sys.executable)
    go = tmp_path / "go"
    script = (f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
              f"os.execve({str(link)!r}, [{str(link)!r}, '-c', 'import time; time.sleep(60)'],"
              " {'SMR_CONTAINER': 'b'})\n")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", str(link), "-c",
                          script], env={**os.environ, "SMR_CONTAINER": "a"})
    try:
        deadline = time.monotonic() + 10
        while not (kids := host.children(p.pid)) or not host.is_shim(kids[0]):
            assert time.monotonic() < deadline, "its smr-init never ran"
            time.sleep(0.05)
        pid = kids[0]
        assert host.Shim.of(pid).container == "a"
        go.write_text("")
        while b"SMR_CONTAINER=b" not in Path(f"/proc/{pid}/environ").read_bytes():
            assert time.monotonic() < deadline, "it never execed"
            time.sleep(0.05)
        monkeypatch.setattr(host, "FIXED_REREAD_S", 0.5)
        deadline = time.monotonic() + 10
        while host.Shim.of(pid).container != "b":
            assert time.monotonic() < deadline, "what it was before its exec was kept"
            time.sleep(0.1)
        assert host.is_shim(pid)
    finally:
        for q in reversed(process_tree(p.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(q, signal.SIGKILL)
        p.wait()



def test_a_process_moving_its_environment_is_not_read_at_every_scan(tmp_path: Path) -> None:
    """A process named smr-init that points its environment at 16 MiB and
    moves its end every millisecond (prctl PR_SET_MM_MAP, no privilege
    needed) costs the agent one read of it, not one at every scan."""
    link = tmp_path / host.SHIM_NAME
    link.symlink_to(sys.executable)
    p = subprocess.Popen([str(link), "-c", BIG_AREA, "env-moving", "16"],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ok"
        host.is_shim(p.pid)  # the first scan that meets it reads it

        def scans() -> None:
            for _ in range(10):
                host.is_shim(p.pid)
                time.sleep(0.01)

        read = read_by(scans)
        assert read < 2 * MiB, f"10 scans of one process read {read} bytes"
    finally:
        p.kill()
        p.wait()


def _big_environment_named_smr_init(tmp_path: Path, n: int) -> list[subprocess.Popen[str]]:
    """``n`` processes named smr-init, each with its environment moved onto
    8 MiB (prctl PR_SET_MM_MAP), none a shim: no PID namespace of its own."""
    link = tmp_path / host.SHIM_NAME
    link.symlink_to(sys.executable)
    ps = [subprocess.Popen([str(link), "-c", BIG_AREA, "env", "8"], stdout=subprocess.PIPE,
                           text=True) for _ in range(n)]
    for p in ps:
        assert p.stdout is not None and p.stdout.readline().strip() == "ok"
    return ps


def test_a_process_that_is_not_a_shim_has_no_environment_read(tmp_path: Path) -> None:
    """SMR_CONTAINER is a shim's (PID 1 of a namespace below the agent's):
    a process a tenant names smr-init, and forks by the thousand, costs the
    agent its status, never its environment."""
    [p] = _big_environment_named_smr_init(tmp_path, 1)
    try:
        read = read_by(lambda: host.is_shim(p.pid))
        assert not host.is_shim(p.pid)
        assert read < 1 * MiB, f"one look at a process that is no shim read {read} bytes"
    finally:
        p.kill()
        p.wait()


def test_more_processes_named_smr_init_than_are_kept_are_not_read_whole_at_every_scan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process more than the agent keeps (here 4 kept, 5 processes):
    every scan meets what the last one dropped, and reads only its status."""
    monkeypatch.setattr(host, "_FIXED_MAX", 4)
    ps = _big_environment_named_smr_init(tmp_path, 5)
    try:
        def scan() -> None:
            for p in ps:
                host.is_shim(p.pid)

        scan()

        def scans() -> None:
            for _ in range(10):
                scan()

        read = read_by(scans)
        assert read < 2 * MiB, f"10 scans of 5 processes read {read} bytes"
    finally:
        for p in ps:
            p.kill()
            p.wait()
