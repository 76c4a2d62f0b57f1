"""The `smr` command on one machine as a new user meets it: one `smr up` per
data directory, no nats-server left behind by a killed one, errors that say
what happened and what to do, no secret on the screen, and commands whose
output is theirs alone (no log lines at the default level).

Every test runs the real command line in processes of its own, with a real
`smr up` (nats-server, CRIU) where it needs one."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from smr import config
from smr.jobs import proc_start_ticks
from smr.natsserver import NatsServer
from tests.helpers.lifetime import interrupt

# A log line as logging.basicConfig in smrctl.cli formats it.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \S+ (DEBUG|INFO|WARNING|ERROR) ",
                      re.MULTILINE)


class Up:
    """`smr up` in a process of its own, on its own data directory."""

    def __init__(self, data: Path, env: dict[str, str]) -> None:
        self.data, self.env = data, env
        self.out = data.parent / f"up-{uuid.uuid4().hex[:6]}.out"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Up:
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "smrctl.cli", "up"],
                                         env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        return self

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_up(self, timeout: float = 120) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "smr up: node" in self.text():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"smr up exited with {self.proc.returncode}:\n{self.text()}")
            time.sleep(0.1)
        pytest.fail(f"smr up did not come up in {timeout}s:\n{self.text()}")

    def nats_pid(self) -> int:
        """Its nats-server: the process whose command line names this data directory's store."""
        store = str(self.data / "nats").encode()
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                argv = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"nats-server") and store in argv:
                return int(p.name)
        pytest.fail("no nats-server of this data directory runs")

    def stop(self) -> None:
        if self.proc:
            interrupt(self.proc)


@pytest.fixture
def env(tmp_path: Path, criu_binary: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SMR_")},
            "SMR_DATA_DIR": str(tmp_path / "data"), "SMR_METRICS_PORT": "0",
            "SMR_NODE_NAME": f"node-{uuid.uuid4().hex[:8]}", "SMR_CRIU": criu_binary}


@pytest.fixture
def ups(tmp_path: Path, env: dict[str, str]) -> Iterator[list[Up]]:
    started: list[Up] = []
    yield started
    for u in started:
        u.stop()


def up(ups: list[Up], tmp_path: Path, env: dict[str, str]) -> Up:
    u = Up(tmp_path / "data", env).start()
    ups.append(u)
    return u


def smr(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "smrctl.cli", *args], env=env,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def start_job(env: dict[str, str], mib: int = 8) -> str:
    job = f"j-{uuid.uuid4().hex[:6]}"
    r = smr(env, "exec", "-i", job, "--", sys.executable, "-m", "smrctl.demo_counter",
            "--mib", str(mib), "--interval", "0.05", "--digest-every", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    return job


def kill_job(env: dict[str, str], job: str) -> None:
    smr(env, "kill", job)


def test_a_second_smr_up_on_the_same_data_directory_is_refused_and_the_first_runs_on(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    first = up(ups, tmp_path, env)
    first.wait_up()
    assert first.proc is not None
    second = up(ups, tmp_path, env)
    assert second.proc is not None
    try:
        rc = second.proc.wait(300)  # bounds a hang: a loaded machine starts Python slowly
    except subprocess.TimeoutExpired:
        pytest.fail(f"a second smr up started beside the first:\n{second.text()}")
    assert rc != 0, second.text()
    assert "already running" in second.text() and f"pid {first.proc.pid}" in second.text(), \
        second.text()
    # The first one is still the machine's: its URL file and its server are untouched.
    r = smr(env, "ps")
    assert r.returncode == 0, r.stdout + r.stderr
    assert first.proc.poll() is None


def test_a_killed_smr_up_leaves_no_nats_server_and_the_next_comes_up_clean(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    first = up(ups, tmp_path, env)
    first.wait_up()
    assert first.proc is not None
    server = first.nats_pid()
    first.proc.kill()
    first.proc.wait()
    deadline = time.monotonic() + 30
    while proc_start_ticks(server) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc_start_ticks(server) is None, "the killed smr up's nats-server runs on"
    again = up(ups, tmp_path, env)
    again.wait_up()
    r = smr(env, "ps")
    assert r.returncode == 0, r.stdout + r.stderr
    log = (tmp_path / "data" / "nats" / "nats-server.log").read_text(errors="replace")
    assert "will rebuild" not in log, "two servers wrote one JetStream directory"


def test_secrets_are_never_printed(ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    key = base64.b64encode(os.urandom(32)).decode()
    shown = smr({**env, "SMR_NATS_PASSWORD": "hunter2-secret", "SMR_ENCRYPTION_KEY": key},
                "config")
    assert shown.returncode == 0, shown.stderr
    assert "hunter2-secret" not in shown.stdout and key not in shown.stdout
    assert "SMR_NATS_PASSWORD=***" in shown.stdout and "SMR_ENCRYPTION_KEY=***" in shown.stdout
    # A stale URL file (its `smr up` gone, as after a reboot): the token stays off the screen.
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    token = "tok-" + uuid.uuid4().hex
    (data / "nats.url").write_text(f"nats://{token}@127.0.0.1:9\n")
    stale = smr(env, "ps")  # its default deadline only bounds a hang
    assert stale.returncode != 0
    assert token not in stale.stdout + stale.stderr, stale.stderr
    # No `smr up` holds the data directory: the file is not tried (ten seconds of reconnecting).
    assert "smr is not running on this machine" in stale.stderr, stale.stderr
    assert not LOG_LINE.search(stale.stderr), stale.stderr


def test_commands_print_no_log_lines_at_the_default_level(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    up(ups, tmp_path, env).wait_up()
    job = start_job(env)
    try:
        for args in (["ps"], ["checkpoint", job, "--leave-running"], ["checkpoints", job],
                     ["status"]):
            r = smr(env, *args)
            assert r.returncode == 0, r.stdout + r.stderr
            assert not LOG_LINE.search(r.stderr + r.stdout), \
                f"smr {args[0]} logged at the default level:\n{r.stderr}"
        verbose = smr(env, "-v", "ps")
        assert LOG_LINE.search(verbose.stderr), "-v shows the log"
    finally:
        kill_job(env, job)


def test_exec_of_a_missing_program_fails_before_anything_is_recorded(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    up(ups, tmp_path, env).wait_up()
    for program in ("/no/such/binary", f"nosuchcmd-{uuid.uuid4().hex[:6]}"):
        r = smr(env, "exec", "-i", "ghost", "--", program)
        assert r.returncode != 0, r.stdout
        assert "started" not in r.stdout
        assert f"cannot run {program}" in r.stderr, r.stderr
    listed = smr(env, "ps")
    assert "ghost" not in listed.stdout


def test_a_wait_that_times_out_says_the_step_goes_on(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    up(ups, tmp_path, env).wait_up()
    job = start_job(env, mib=64)
    try:
        r = smr(env, "checkpoint", job, "--leave-running", "--timeout", "0.01",
                "--request-id", f"slow-{job}")
        assert r.returncode not in (0, 1), r.stdout + r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert "goes on" in r.stderr and f"slow-{job}" in r.stderr, r.stderr
        # It did go on: waiting again under the same key gets its result.
        again = smr(env, "checkpoint", job, "--leave-running", "--request-id", f"slow-{job}")
        assert again.returncode == 0, again.stdout + again.stderr
        assert "generation 1" in again.stdout, again.stdout
    finally:
        kill_job(env, job)


def test_a_full_disk_is_reported_as_a_full_disk_and_the_job_runs_on(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(small)], check=True)
    try:
        # The dump fits its work directory; the store, on a small disk, does not.
        full = {**env, "SMR_STORAGE_PATH": str(small / "checkpoints")}
        up(ups, tmp_path, full).wait_up()
        job = start_job(full, mib=64)
        try:
            r = smr(full, "checkpoint", job)
            assert r.returncode == 1, r.stdout + r.stderr
            assert "this is a bug" not in r.stderr and "internal error" not in r.stderr, r.stderr
            assert "no space left" in r.stderr and "SMR_STORAGE_PATH" in r.stderr, r.stderr
            ps = smr(full, "ps")
            assert re.search(rf"^{job}\s+running", ps.stdout, re.MULTILINE), ps.stdout
        finally:
            kill_job(full, job)
    finally:
        for u in ups:
            u.stop()
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_command_right_after_smr_up_waits_for_it_to_start(
        tmp_path: Path, env: dict[str, str], settings: config.Settings) -> None:
    """`smr up &` then a command at once, as the README's quick start reads:
    here the test plays the starting `smr up` (it holds the data directory's
    lock and writes the URL file a second later, with a real nats-server)."""
    data = tmp_path / "data"
    data.mkdir()
    fd = os.open(data / "up.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    server = NatsServer(settings.nats_server_binary(), tmp_path / "nats")
    try:
        ps = subprocess.Popen([sys.executable, "-m", "smrctl.cli", "ps"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        with contextlib.suppress(subprocess.TimeoutExpired):
            ps.wait(10)  # long past its start and its look for the URL file
            pytest.fail(f"it did not wait for the starting smr up: {ps.communicate()}")
        server.start()
        (data / "nats.url").write_text(server.client_url + "\n")
        out, err = ps.communicate(timeout=120)
        assert ps.returncode == 0, out + err
        assert out.startswith("ID"), out
    finally:
        server.stop()
        os.close(fd)


def test_a_request_id_reused_for_another_kind_is_refused(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    up(ups, tmp_path, env).wait_up()
    job = start_job(env)
    key = f"key-{uuid.uuid4().hex[:6]}"
    try:
        first = smr(env, "checkpoint", job, "--leave-running", "--request-id", key)
        assert first.returncode == 0, first.stdout + first.stderr
        copy = f"{job}-copy"
        again = smr(env, "restore", job, "--as", copy, "--request-id", key)
        assert again.returncode != 0, again.stdout
        assert "pid None" not in again.stdout
        assert f"request id {key} belongs to a checkpoint" in again.stderr, again.stderr
        assert copy not in smr(env, "ps").stdout
    finally:
        kill_job(env, job)


def test_an_invalid_encryption_key_stops_every_command_without_showing_it(
        env: dict[str, str]) -> None:
    bad = "short-secret-key"
    for args in (["config"], ["ps"]):
        r = smr({**env, "SMR_ENCRYPTION_KEY": bad}, *args)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "SMR_ENCRYPTION_KEY" in r.stderr and "32-byte" in r.stderr, r.stderr
        assert bad not in r.stdout + r.stderr


def test_a_copy_restored_under_another_id_writes_its_own_log(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    up(ups, tmp_path, env).wait_up()
    job = start_job(env)
    copy = f"{job}-copy"
    logs = tmp_path / "data" / "logs"
    try:
        r = smr(env, "checkpoint", job, "--leave-running")
        assert r.returncode == 0, r.stdout + r.stderr
        r = smr(env, "restore", job, "--as", copy)
        assert r.returncode == 0, r.stdout + r.stderr
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            own = logs / f"{copy}.log"
            if own.exists() and "step" in own.read_text(errors="replace"):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the copy wrote nothing to {copy}.log; logs: "
                        f"{sorted(p.name for p in logs.iterdir())}")
    finally:
        kill_job(env, copy)
        kill_job(env, job)


def test_a_stopped_copy_is_pointed_at_the_checkpoint_it_came_from(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    """Each hint must be one that works: a copy has no checkpoints of its own."""
    up(ups, tmp_path, env).wait_up()
    job = start_job(env)
    copy = f"{job}-copy"
    try:
        assert smr(env, "checkpoint", job, "--leave-running").returncode == 0
        assert smr(env, "restore", job, "--as", copy).returncode == 0
        kill_job(env, copy)
        r = smr(env, "checkpoint", copy)
        assert r.returncode == 1, r.stdout
        hint = re.search(r"`(smr restore [^`]+)`", r.stderr)
        assert hint, r.stderr
        again = smr(env, *hint.group(1).split()[1:])
        assert again.returncode == 0, f"the hint {hint.group(1)!r} does not work:\n{again.stderr}"
    finally:
        kill_job(env, copy)
        kill_job(env, job)


def tracks_dirty_memory(criu: str) -> bool:
    r = subprocess.run([criu, "check", "--feature", "mem_dirty_track"], capture_output=True)
    return r.returncode == 0 and b"OFF" not in r.stdout + r.stderr


def test_a_pre_dump_this_kernel_cannot_take_is_said_to_have_been_a_full_dump(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    up(ups, tmp_path, env).wait_up()
    job = start_job(env)
    try:
        r = smr(env, "checkpoint", job, "--leave-running", "--pre-dump")
        assert r.returncode == 0, r.stdout + r.stderr
        said = "no pre-dump: this kernel cannot track dirty memory" in r.stdout
        if tracks_dirty_memory(env["SMR_CRIU"]):
            assert not said, r.stdout
        else:
            assert said and "the dump was a full one" in r.stdout, \
                f"the fallback to a full dump went unsaid:\n{r.stdout}"
    finally:
        kill_job(env, job)


TRACED = """
import ctypes, os, time
if os.fork() == 0:
    ctypes.CDLL(None).ptrace(0, 0, None, None)  # PTRACE_TRACEME: CRIU cannot seize it
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_a_failed_dump_names_a_full_log_that_exists(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    up(ups, tmp_path, env).wait_up()
    job = f"j-{uuid.uuid4().hex[:6]}"
    r = smr(env, "exec", "-i", job, "--", sys.executable, "-c", TRACED)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        r = smr(env, "checkpoint", job, "--leave-running")
        assert r.returncode == 1, r.stdout + r.stderr
        named = re.findall(r"full log: (\S+)", r.stderr)
        assert named, f"the hint names no log:\n{r.stderr}"
        for path in named:
            assert Path(path).is_file(), f"the hint names {path}, which is gone:\n{r.stderr}"
            assert "Error" in Path(path).read_text(errors="replace")
    finally:
        kill_job(env, job)


def test_a_jobs_log_holds_only_its_own_output_after_a_final_checkpoint_and_restore(
        ups: list[Up], tmp_path: Path, env: dict[str, str]) -> None:
    up(ups, tmp_path, env).wait_up()
    job = start_job(env)
    log = tmp_path / "data" / "logs" / f"{job}.log"
    try:
        for args in (["checkpoint", job], ["restore", job]):
            r = smr(env, *args)
            assert r.returncode == 0, r.stdout + r.stderr
        # The restored job writes on: its next line shows the log is live again.
        before = log.read_text(errors="replace").count("\n")
        deadline = time.monotonic() + 30
        while log.read_text(errors="replace").count("\n") <= before + 1:
            assert time.monotonic() < deadline, "the restored job writes nothing"
            time.sleep(0.1)
    finally:
        kill_job(env, job)
    text = log.read_text(errors="replace")
    strangers = [line for line in text.splitlines()
                 if not line.startswith("step=")]
    assert not strangers, f"lines in the job's log that the job did not write: {strangers}"


@pytest.mark.parametrize("given", ["0", "-2", "latest"])
def test_a_generation_that_cannot_exist_is_refused_before_smr_is_asked(
        given: str, tmp_path: Path, env: dict[str, str]) -> None:
    """Generations count from 1: `--generation 0` is refused by the command
    line with the way to find one, not sent for the schema to refuse in its
    own words. No `smr up` runs here: nothing was asked of it."""
    r = smr(env, "restore", "some-job", "--generation", given)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "generations are numbered from 1" in r.stderr, r.stderr
    assert "smr checkpoints ID" in r.stderr and "not running" not in r.stderr, r.stderr
