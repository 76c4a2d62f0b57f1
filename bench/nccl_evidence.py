"""What an NCCL rank shows from outside of the transport NCCL chose, on a
machine with two GPUs: the gate (smr.gpu.gpugate) must know, before it locks
anything, whether ranks import their peers' GPU memory (NCCL's P2P
transport), which driver 580 never restores.

    python3 bench/nccl_evidence.py [--variants p2p,net,...] [--out DIR]

Each variant starts tests/workloads/ddp_train.py under torchrun (two ranks,
one GPU each, NCCL_DEBUG=INFO so NCCL's log says which transport it chose),
waits for step 20, and prints side by side for each rank what can be read
of it from /proc and NVML: its descriptors, its mappings of device files
and shared memory, its threads' names, its sockets (TCP by state, UNIX by
name), the GPUs NVML lists it on and NCCL_* in /proc/PID/environ. Variants:

- ``p2p``: NCCL's defaults (P2P over NVLink, cuMem);
- ``p2p-legacy``: P2P with NCCL_CUMEM_ENABLE=0 (CUDA IPC handles);
- ``shm``: NCCL_P2P_DISABLE=1 (shared memory between the ranks);
- ``net``: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (sockets);
- ``flip``: started as ``net``, each rank sets NCCL_P2P_DISABLE=0 in its own
  environment before NCCL starts;
- ``unset``: started as ``net``, each rank deletes NCCL_P2P_DISABLE;
- ``net-added``: started as ``net``, each rank adds variables of its own.

After each rank's facts, what smr's gate (smr.gpu.gpugate.check_peers) says
of the job, and NCCL_P2P_DISABLE as each rank holds it now (smr.process.liveenv).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.nccl_probe import holdings, nvidia_smi
from smr.gpu import gpugate
from smr.process import liveenv
from smr.process.tree import process_tree

VARIANTS: dict[str, dict[str, str]] = {
    "p2p": {},
    "p2p-legacy": {"NCCL_CUMEM_ENABLE": "0"},
    "shm": {"NCCL_P2P_DISABLE": "1"},
    "net": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
    "flip": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "EVIDENCE_FLIP": "0"},
    "unset": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "EVIDENCE_FLIP": "unset"},
    "net-added": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "EVIDENCE_FLIP": "add"},
}

# A rank's script that changes its own environment before NCCL starts, as a
# job script may (os.environ), then runs the workload as torchrun would.
_FLIP = """import os, runpy, sys
how = os.environ.pop("EVIDENCE_FLIP", None)
if how == "unset":
    os.environ.pop("NCCL_P2P_DISABLE", None)
elif how == "add":  # new variables move the C library's environment to the heap
    os.environ.update({f"ADDED{i}": "x" * i for i in range(40)})
elif how is not None:
    os.environ["NCCL_P2P_DISABLE"] = how
sys.argv[0] = "ddp_train"
runpy.run_module("tests.workloads.ddp_train", run_name="__main__", alter_sys=True)
"""


def threads(pid: int) -> dict[str, int]:
    names: collections.Counter[str] = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            names[re.sub(r"\d+", "N", comm)] += 1
        except OSError:
            continue
    return dict(names)


_TCP_STATES = {"01": "ESTABLISHED", "0A": "LISTEN", "06": "TIME_WAIT", "08": "CLOSE_WAIT"}


def sockets(pid: int) -> dict[str, int]:
    """A rank's sockets by kind: TCP by state (and whether the peer is
    local), UNIX by bound name (abstract ones start with @)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if m := re.fullmatch(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}")):
                inodes.add(m.group(1))
        except OSError:
            continue
    kinds: collections.Counter[str] = collections.Counter()
    seen = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes:
                seen.add(f[9])
                kinds[f"{table} {_TCP_STATES.get(f[3], f[3])}"] += 1
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if f[6] in inodes:
            seen.add(f[6])
            kinds[f"unix {re.sub(r'[0-9a-f]{6,}|[0-9]+', 'N', f[7]) if len(f) > 7 else '-'}"] += 1
    kinds["other"] = len(inodes - seen)
    return dict(kinds)


def nccl_env(pid: int) -> dict[str, str]:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode(errors="replace").split("=", 1) for e in env
                if e.startswith(b"NCCL_") and b"=" in e)


def run(variant: str, out: Path, steps: int) -> None:
    def say(*what: object) -> None:
        print(f"[{variant}]", *what, flush=True)

    env = dict(os.environ, NCCL_DEBUG="INFO", PYTHONPATH=str(Path.cwd()), **VARIANTS[variant])
    script = out / "evidence_rank.py"
    script.write_text(_FLIP)
    log = out / f"evidence-{variant}-job.log"
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), "--steps", str(steps), "--interval", "0.05"],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def step() -> int:
        m = re.findall(r"step=(\d+)", log.read_text())
        return int(m[-1]) if m else 0

    t0 = time.monotonic()
    while step() < 20 and job.poll() is None and time.monotonic() - t0 < 180:
        time.sleep(0.5)
    smi = nvidia_smi()
    ranks = [p for p in process_tree(job.pid) if str(p) in smi]
    say(f"at step {step()} after {time.monotonic() - t0:.1f}s: ranks {ranks}")
    say("nvidia-smi:", smi.replace("\n", " | "))
    for r in ranks:
        fds, maps = holdings(r)
        say(f"rank {r} environ: {nccl_env(r)}")
        say(f"rank {r} descriptors: {fds}")
        say(f"rank {r} mappings: {maps}")
        say(f"rank {r} threads: {threads(r)}")
        say(f"rank {r} sockets: {sockets(r)}")
    uuids: dict[int, list[str]] = {}
    for line in smi.splitlines():
        pid, _, uuid = line.partition(", ")
        if pid.strip().isdigit():
            uuids.setdefault(int(pid), []).append(uuid.split(",")[0].strip())
    for r in ranks:
        try:
            say(f"rank {r} NCCL_P2P_DISABLE now: {liveenv.getenv(r, 'NCCL_P2P_DISABLE')!r}")
        except liveenv.EnvironUnreadable as e:
            say(f"rank {r} NCCL_P2P_DISABLE now: unreadable: {e}")
    try:
        gpugate.check_peers(uuids)
        say("gate: lets the job through")
    except gpugate.GateRefused as e:
        say(f"gate: refused, {e.code}: {e.message}")
    os.killpg(job.pid, 9)
    job.wait()
    text = log.read_text()
    say("NCCL's transports:", sorted(set(re.findall(r"via (\S+)", text))))
    say("NCCL's settings:", sorted(set(re.findall(r"(NCCL_\w+) set by environment to (\S+)",
                                                  text))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for v in a.variants.split(","):
        run(v, a.out, a.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
