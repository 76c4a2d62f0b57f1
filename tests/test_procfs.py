"""Reading other processes' /proc files stays bounded whatever they hold.

A process with no privilege can point its argument or environment area at a
mapping of gigabytes (prctl PR_SET_MM_MAP needs no capability for these
fields): /proc/<pid>/{cmdline,environ} then read as that many bytes. The
agent's look for smr-init (every process, several times a second), a
recovery's look for a CRIU still running and the GPU gate's look at a
job's environment must cost the same for such a process as for any other.
Real processes, dropped to nobody; smr.process.procfs reads them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.containers import host
from smr.process import criu, procfs
from smr.process.tree import process_tree

# Maps SIZE MiB read-only and points the argument ("args") or environment
# ("env") area at it, then waits.
BIG_AREA = r'''
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
size = int(sys.argv[2]) << 20
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
addr = libc.mmap(None, size, 1, 0x22 | 0x4000, -1, 0)  # PROT_READ, private anonymous, noreserve
f = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
g = lambda n: int(f[n - 3])
libc.sbrk.restype = ctypes.c_void_p
class M(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "start_code end_code start_data end_data start_brk brk start_stack "
        "arg_start arg_end env_start env_end auxv").split()] + [
        ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]
area = (addr, addr + size, addr + size, addr + size) if sys.argv[1] == "args" else \
    (g(48), g(49), addr, addr + size)
m = M(g(26), g(27), g(45), g(46), g(47), libc.sbrk(0), g(28), *area, 0, 0, 0xffffffff)
if libc.prctl(35, 14, ctypes.byref(m), ctypes.sizeof(m), 0) != 0:  # PR_SET_MM, PR_SET_MM_MAP
    print("refused", ctypes.get_errno(), flush=True)
else:
    print("ok", flush=True)
i = 0
while sys.argv[1] == "env-moving":  # its end moved every millisecond
    i = (i + 1) % 4096
    m.env_end = addr + size - i
    libc.prctl(35, 14, ctypes.byref(m), ctypes.sizeof(m), 0)
    time.sleep(0.001)
time.sleep(600)
'''


_DROP = ("import ctypes, os, sys, time\n"
         "os.setgroups([]); os.setgid(65534); os.setuid(65534)")


def _nobody() -> None:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


@pytest.fixture
def huge(request: pytest.FixtureRequest) -> Iterator[Callable[..., int]]:
    """Start a process of nobody's whose ``area`` ("args" or "env") is
    ``mib`` MiB, optionally under ``argv`` (a PID namespace's PID 1 named
    smr-init); its PID."""
    procs: list[subprocess.Popen[str]] = []

    def start(area: str, mib: int, argv: list[str] | None = None) -> int:
        # Under ``argv`` it drops to nobody itself, once its program is open.
        script = BIG_AREA.replace("import ctypes, os, sys, time", _DROP) if argv else BIG_AREA
        cmd = [*(argv or ["/usr/bin/python3"]), "-c", script, area, str(mib)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                             preexec_fn=None if argv else _nobody)
        procs.append(p)
        assert p.stdout is not None
        said = p.stdout.readline().strip()
        if said != "ok":
            pytest.skip(f"PR_SET_MM_MAP refused here: {said}")
        return p.pid

    yield start
    for p in procs:
        # The whole tree: a namespace's PID 1 that dropped to nobody lost the
        # parent-death signal `unshare --kill-child` gave it, and a stray one
        # named smr-init would be every later agent's shim to look at.
        for q in reversed(process_tree(p.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(q, signal.SIGKILL)
        p.wait()


def read_by(op: Callable[[], Any]) -> int:
    """Bytes this process read (read(2), /proc/self/io's rchar) while ``op``
    ran: what a look at a tenant's process costs, whatever its CPU time on
    a loaded machine."""
    def rchar() -> int:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
        raise AssertionError("no rchar in /proc/self/io")
    before = rchar()
    op()
    return rchar() - before


MiB = 1 << 20


def test_a_look_for_smr_init_reads_little_of_a_command_line_of_16_gib(
        huge: Callable[..., int]) -> None:
    pid = huge("args", 16 << 10)
    read = read_by(lambda: host.is_shim(pid))
    assert not host.is_shim(pid)
    assert read < MiB, f"is_shim read {read} bytes"


def test_a_look_for_a_criu_still_running_reads_little_of_a_large_command_line(
        huge: Callable[..., int]) -> None:
    huge("args", 64)
    read = read_by(lambda: criu.still_running(Path("/nonexistent/images")))
    assert read < 4 * MiB, (
        f"one walk of /proc read {read} bytes, with one process's argument area 64 MiB")


def test_one_variable_of_a_large_environment_costs_little(huge: Callable[..., int]) -> None:
    pid = huge("env", 64)
    read = read_by(lambda: procfs.env_value(pid, "NCCL_P2P_DISABLE"))
    assert procfs.env_value(pid, "NCCL_P2P_DISABLE") is None
    assert read <= procfs.ENVIRON_MAX + 64 * 1024, f"env_value read {read} bytes of 64 MiB"


def test_a_scan_finding_a_pid_1_named_smr_init_reads_little_of_its_environment(
        huge: Callable[..., int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any container's PID 1 whose argv[0] ends in smr-init is taken for a
    shim (the tenant names its own entrypoint): the scan reads its
    SMR_CONTAINER, never its whole environment."""
    link = tmp_path / host.SHIM_NAME
    link.symlink_to("/usr/bin/python3")
    unshare = ["unshare", "-p", "--fork", "--kill-child", "--", str(link)]
    started = huge("env", 64, argv=unshare)
    mine = [s for s in host.shims() if str(tmp_path).encode() in (procfs.argv0(s.pid) or b"")]
    assert mine, "its PID 1 was not taken for a shim"
    # The next scan, counted over this test's processes only: what it reads
    # of the rest of the host is other tests' (run beside it) to size.
    tree = process_tree(started)
    monkeypatch.setattr(host, "all_pids", lambda: tree)
    read = read_by(host.shims)  # the scan after the one that met it
    assert [s.pid for s in host.shims()] == [s.pid for s in mine]
    assert read < 2 * MiB, f"one scan read {read} bytes"


def test_env_value_finds_the_first_setting_as_getenv_does(tmp_path: Path) -> None:
    env = {"A": "1", "SMR_CONTAINER": "first", "B": "x=y"}
    p = subprocess.Popen(["sleep", "30"], env=env)
    try:
        deadline = time.monotonic() + 5
        while procfs.env_value(p.pid, "B") is None:  # exec done
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert procfs.env_value(p.pid, "A") == "1"
        assert procfs.env_value(p.pid, "SMR_CONTAINER") == "first"
        assert procfs.env_value(p.pid, "B") == "x=y"
        assert procfs.env_value(p.pid, "CONTAINER") is None  # a suffix of a name is not it
        assert procfs.argv(p.pid) == [b"sleep", b"30", b""]
        assert procfs.argv0(p.pid) == b"sleep"
    finally:
        p.kill()
        p.wait()
    assert procfs.env_value(p.pid, "A") is None  # gone


def test_a_streamed_local_restore_is_a_criu_still_at_work_on_its_images(
        tmp_path: Path) -> None:
    """criu.restore(images, stream=DIR) runs `criu restore ... --stream -W
    IMAGES ... -D DIR`: a recovery's wait for the CRIU still at work on
    IMAGES must see it, or it decides (restores again) while it runs."""
    images = tmp_path / "req" / "images"
    images.mkdir(parents=True)
    fake = tmp_path / "criu"
    # It waits on a shell builtin: a child forked to run `sleep` would show
    # its parent's command line until its exec, a second "CRIU" for a moment.
    fake.write_text("#!/bin/sh\nread line\n")
    fake.chmod(0o755)
    p = subprocess.Popen([str(fake), "restore", "-d", "--file-locks", "--pidfile",
                          str(images.parent / "restored.pid"), "--tcp-close", "--stream",
                          "-W", str(images), "-D", "/tmp/smr-abcdef", "-o", "restore.log",
                          "-v4"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 5
        while str(fake).encode() not in (procfs.argv(p.pid) or []):
            assert time.monotonic() < deadline, "it never ran"
            time.sleep(0.01)
        assert criu.still_running(images) == [p.pid]
        assert criu.still_running(tmp_path / "other") == []
    finally:
        p.kill()
        p.wait()


# Gives itself 65536 groups (a container's root holds CAP_SETGID by default):
# its /proc/<pid>/status is then half a MiB, built whole at each read.
_GROUPS = r'''
import os, time
os.setgroups(list(range(1000000, 1065536)))
os.setgid(65534); os.setuid(65534)
print("ok", flush=True); time.sleep(60)
'''


def test_processes_named_smr_init_with_a_huge_status_cost_the_next_scans_little(
        tmp_path: Path) -> None:
    """The look for smr-init reads the PID namespaces (status's NSpid) of each
    process named so: once a process, not at every scan."""
    link = tmp_path / host.SHIM_NAME
    link.symlink_to("/usr/bin/python3")
    procs = [subprocess.Popen([str(link), "-c", _GROUPS], stdout=subprocess.PIPE, text=True)
             for _ in range(20)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ok"
        size = len(Path(f"/proc/{procs[0].pid}/status").read_bytes())
        assert size > 256 << 10, f"status is only {size} bytes"
        for p in procs:  # the first scan that meets them
            assert not host.is_shim(p.pid)
        read = read_by(lambda: [host.is_shim(p.pid) for p in procs])
        assert read < MiB, f"the next scan's 20 looks read {read} bytes (status {size} each)"
    finally:
        for p in procs:
            p.kill()
            p.wait()


# One thread, whose memory takes a while to free (about 0.1 s).
BIG = """
ballast = bytearray(768 << 20)
for i in range(0, len(ballast), 4096):
    ballast[i] = 1
print("ok", flush=True)
import time; time.sleep(60)
"""


def test_a_killed_process_still_freeing_its_memory_has_ended() -> None:
    """A process killed during its dump (CRIU then fails: a thread it was
    saving is gone) exits for as long as its memory takes to free, its only
    thread shown running meanwhile, not yet a zombie. From the kill on it
    has ended: the failure is its exit (job-exited), not CRIU's. Real
    processes, every look from the kill to the reaping."""
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", BIG], stdout=subprocess.PIPE, text=True)
        looks = exiting = 0
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "ok"
            assert not procfs.ended(p.pid), "a running process taken for ended"
            os.kill(p.pid, signal.SIGKILL)
            while p.poll() is None:  # reaped only once it is gone
                exiting += procfs.stat_fields(p.pid) is not None  # not a zombie yet
                looks += 1
                assert procfs.ended(p.pid), "a killed process taken for running"
        finally:
            p.kill()
            p.wait()
        assert procfs.ended(p.pid)
        if exiting:
            return
    pytest.fail(f"no look in 3 tries saw a killed process before it was a zombie ({looks})")


# Live processes whose threads change under a look: "chain", a first thread
# that ended while each thread starts the next and ends; "exec", a thread
# other than the first execs the program again, for ever (same PID).
CHANGING = r"""
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
static char *again[3];
static void *link_(void *a) {
    pthread_t t; pthread_attr_t at; pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    for (volatile int i = 0; i < 20000; i++);
    pthread_create(&t, &at, link_, 0);
    return 0;
}
static void *ex(void *a) { execv("/proc/self/exe", again); return 0; }
int main(int c, char **v) {
    pthread_t t;
    if (!strcmp(v[1], "chain")) {
        pthread_create(&t, 0, link_, 0);
        printf("ok\n"); fflush(stdout);
        pthread_exit(0);
    }
    if (!strcmp(v[1], "exec")) { printf("ok\n"); fflush(stdout); }
    again[0] = v[0]; again[1] = "again";
    pthread_create(&t, 0, ex, 0);
    for (;;) pause();
}
"""


@pytest.mark.parametrize("how", ["chain", "exec"])
def test_a_live_process_whose_threads_change_has_not_ended(tmp_path: Path, how: str) -> None:
    """A look that lists a process's threads can miss the one running: the
    next thread appears after the listing, or the thread that execs takes
    the first one's PID. A pod's workload so taken for ended would have its
    final checkpoint refused (job-not-running). Real processes, looked at
    for 2 s (one look in about a hundred missed before)."""
    (tmp_path / "p.c").write_text(CHANGING)
    subprocess.run(["gcc", "-O2", "-pthread", "-o", str(tmp_path / "p"), str(tmp_path / "p.c")],
                   check=True)
    p = subprocess.Popen([str(tmp_path / "p"), how], stdout=subprocess.PIPE, text=True)
    looks = wrong = 0
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ok"
        end = time.monotonic() + 2
        while time.monotonic() < end:
            looks += 1
            wrong += procfs.ended(p.pid)
        assert p.poll() is None, "the program ended: the test proves nothing"
    finally:
        p.kill()
        p.wait()
    assert wrong == 0, f"{wrong} of {looks} looks took a live process for ended"
