"""A node agent in a process of its own (``python -m services.agent``, as the
DaemonSet runs it), started inside a memory cgroup with a limit, as the
DaemonSet's ``resources.limits.memory`` puts it: what the agent is charged is
then what the kernel holds it to, and an OOM kill takes the agent, never the
test run beside it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from smr import config

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[Path]:
    """A fresh memory cgroup limited to ``limit`` bytes, no swap (cgroup v1
    beside this process's, or v2 under the root); removed after."""
    line = next((ln for ln in Path("/proc/self/cgroup").read_text().splitlines()
                 if "memory" in ln.split(":")[1].split(",")), None)
    name = f"smr-agent-{uuid.uuid4().hex[:8]}"
    if line is not None:
        cg = Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/") / name
        limits = {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}
    elif "memory" in Path("/sys/fs/cgroup/cgroup.subtree_control").read_text().split():
        cg = Path("/sys/fs/cgroup") / name
        limits = {"memory.max": limit, "memory.swap.max": 0}
    else:
        pytest.skip("no memory cgroup controller here to limit the agent with")
    cg.mkdir()
    try:
        for knob, value in limits.items():
            if (cg / knob).exists():  # memsw and swap.max exist only where swap is accounted
                (cg / knob).write_text(str(value))
        yield cg
    finally:
        for _ in range(50):  # its processes are gone once reaped; the cgroup then goes
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def peak(cg: Path) -> int:
    """The most the cgroup was charged, in bytes."""
    for knob in ("memory.max_usage_in_bytes", "memory.peak"):
        if (cg / knob).exists():
            return int((cg / knob).read_text())
    raise AssertionError(f"{cg} records no peak")


def oom_kills(cg: Path) -> int:
    """How many processes the kernel killed in ``cg`` for its limit."""
    for knob in ("memory.oom_control", "memory.events"):
        if (cg / knob).exists():
            for ln in (cg / knob).read_text().splitlines():
                key, _, value = ln.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return 0


def env_of(settings: config.Settings, **more: str) -> dict[str, str]:
    """``settings`` (those not at their defaults, and ``more``) as the SMR_
    environment variables the agent reads; checked to read back the same."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(config.PREFIX)}
    default = config.load({})
    for key, value in {**settings.values, **more}.items():
        if key in more or value != default.values[key]:
            env[config.PREFIX + key] = (("true" if value else "false")
                                        if isinstance(value, bool) else str(value))
    back = config.load(env)
    wrong = {k for k in settings.values if k not in more and back.values[k] != settings.values[k]}
    assert not wrong, f"settings that do not survive the environment: {wrong}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                        if p)
    return env


class AgentProcess:
    """``python -m services.agent`` for one node, inside ``cgroup``."""

    def __init__(self, env: dict[str, str], cgroup: Path, log: Path) -> None:
        self.cgroup = cgroup
        self.log = log
        self.health = int(env["SMR_HEALTH_PORT"])
        with log.open("wb") as out:
            # The shell joins the cgroup, then becomes the agent: every byte
            # the agent ever allocates is charged there.
            self.proc = subprocess.Popen(
                ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup),
                 sys.executable, "-m", "services.agent"],
                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    def ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the agent exited {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health}/readyz",
                                            timeout=1) as r:
                    if r.status == 200:
                        return
            time.sleep(0.2)
        raise AssertionError(f"the agent was not ready in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
