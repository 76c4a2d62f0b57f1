"""Run inside a PID namespace whose PID 1 never reaps (tests/test_reaping.py):
`smr up`, then a job started the way GPU jobs are (`smr exec --gpu`: no PID
namespace of its own, so its restore needs its very PIDs), checkpointed and
restored twice through the CLI. Prints one JSON line with what happened.

    python -m tests.helpers.pid1_scenario DATA_DIR [--child]

``--child``: the job has a child process (as PyTorch's compile workers are),
and it goes through three rounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def smr(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "smrctl.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def steps(log: Path) -> list[int]:
    return [int(ln.split()[0].split("=")[1]) for ln in log.read_text().splitlines()
            if ln.startswith("step=")]


def wait_steps(log: Path, more_than: int, timeout: float = 60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = steps(log) if log.exists() else []
        if got and got[-1] > more_than:
            return got[-1]
        time.sleep(0.05)
    raise SystemExit(f"the job printed no step after {more_than}")


def main() -> None:
    data = Path(sys.argv[1])
    os.environ["SMR_DATA_DIR"] = str(data)
    out: dict[str, object] = {"pid1": Path("/proc/1/comm").read_text().strip()}
    up_log = open(data / "up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "smrctl.cli", "up"], stdout=up_log,
                          stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if (data / "nats.url").exists() and b"Ctrl-C" in (data / "up.log").read_bytes():
                break
            time.sleep(0.1)
        log = data / "job.log"
        r = smr("exec", "--gpu", "-i", "j", "--log", str(log), "--", sys.executable, "-m",
                "smrctl.demo_counter", "--mib", "8", "--interval", "0.05", "--digest-every", "1",
                *sys.argv[2:3])
        out["exec"] = r.returncode
        wait_steps(log, 3)
        results = []
        for _ in range(3 if "--child" in sys.argv else 2):
            ck = smr("checkpoint", "j", "--wait")
            last = steps(log)[-1]
            rs = smr("restore", "j", "--wait")
            entry = {"checkpoint": ck.returncode, "restore": rs.returncode,
                     "restore_err": rs.stderr.strip()[-1500:], "frozen_at": last}
            if rs.returncode == 0:
                wait_steps(log, last + 1)
                entry["resumed_with"] = min(s for s in steps(log)[::-1] if s > last)
            results.append(entry)
            if rs.returncode:
                break
        out["cycles"] = results
        smr("kill", "j")
    finally:
        up.terminate()
        up.wait(60)
        out["up_log"] = (data / "up.log").read_text()[-1500:]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
