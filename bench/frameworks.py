# ruff: noqa: ASYNC220, ASYNC221 - a driver: nothing else runs beside it
"""The GPU frameworks matrix (issue #26), as a user runs it: `smr up`, each
workload started with `smr exec --gpu`, one heartbeat (a leave-running
checkpoint) and N migrations (checkpoint, then restore) through smr's bus,
then the job runs to its end and its ``final=`` hash must equal that of an
uninterrupted run of the same command on the same GPU.

    python3 bench/frameworks.py [--only NAME ...] [--migrations 3] [--throughput] > log

``--only hf-generate`` runs the Hugging Face server (tests/workloads/hf_generate.py):
its answers over HTTP, not steps, are compared (run_hf).

Prints, per workload and step, the result, the checkpoint size, the
downtime (heartbeat: the driver's lock to its unlock; migration: from the
checkpoint request to the restore's answer) and restore-to-running (the
restore's own total), and a JSON line per workload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from smr import config
from smr.contract.messages import CkptDone, CkptRequested, RestoreDone, RestoreRequested, Target
from smrctl import embedded
from tests.workloads import hf_generate

PY = sys.executable
DET_XLA = "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
WORKLOADS: dict[str, tuple[list[str], dict[str, str]]] = {
    "jax-noprealloc": ([PY, "-m", "tests.workloads.jax_mlp", "--steps", "400", "--gib", "1"],
                       {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_FLAGS": DET_XLA}),
    "jax-frac012": ([PY, "-m", "tests.workloads.jax_mlp", "--steps", "300", "--gib", "1"],
                    {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.12", "XLA_FLAGS": DET_XLA}),
    # One JAX process that sees both GPUs of a two-GPU machine: XLA enables
    # peer access between them, which driver 580 does not restore; smr
    # refuses it before the lock (gpu-peer-access) and it runs on.
    "jax-2gpu": ([PY, "-m", "tests.workloads.jax_mlp", "--steps", "300", "--gib", "1"],
                 {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.12", "XLA_FLAGS": DET_XLA}),
    "torch-compile": ([PY, "-m", "tests.workloads.torch_train", "--steps", "400",
                       "--compile", "default"], {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    # Inductor's compile workers forked after a restore map /dev/nvidia*
    # without a CUDA context, and the next dump fails (handle_device_vma):
    # with one compile thread, Inductor compiles in the process itself.
    "torch-compile-1t": ([PY, "-m", "tests.workloads.torch_train", "--steps", "400",
                          "--compile", "default"], {"CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                                                    "TORCHINDUCTOR_COMPILE_THREADS": "1"}),
    "torch-compile-ro": ([PY, "-m", "tests.workloads.torch_train", "--steps", "400",
                          "--compile", "reduce-overhead"], {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    "dataloader": ([PY, "-m", "tests.workloads.torch_train", "--steps", "400", "--loader"],
                   {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    "dataloader-spawn": ([PY, "-m", "tests.workloads.torch_train", "--steps", "400", "--loader",
                          "--spawn"], {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    # Two processes on two GPUs, NCCL all-reducing every step (nvidia-h200-x2):
    # as NCCL picks its transports (P2P over NVLink, shared memory), and over
    # sockets only (no CUDA IPC between the two processes).
    "ddp-nccl": ([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                  "-m", "tests.workloads.ddp_train", "--steps", "300"],
                 {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    # The same with smr's cooperative path (`import smr.coop`, docs/gpu.md):
    # NCCL's own transports (P2P over NVLink) between checkpoints; before
    # each, the ranks drop their communicators at a step boundary.
    "ddp-coop": ([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                  "-m", "tests.workloads.ddp_train", "--steps", "300", "--coop"],
                 {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    "ddp-nccl-net": ([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                      "2", "-m", "tests.workloads.ddp_train", "--steps", "300"],
                     {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_P2P_DISABLE": "1",
                      "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}),
}


def steps(log: Path) -> int:
    last = 0
    for ln in log.read_text(errors="replace").splitlines():
        if ln.startswith("step="):
            last = int(ln.split()[0][5:])
    return last


def final(text: str) -> str | None:
    for ln in text.splitlines():
        if ln.startswith("final="):
            return ln.split()[0][6:]
    return None


async def wait_step(log: Path, n: int, timeout: float = 240, stall: float = 60) -> int:
    deadline = time.monotonic() + timeout
    last, moved = steps(log), time.monotonic()
    while time.monotonic() < deadline:
        if (s := steps(log)) >= n:
            return s
        if s != last:
            last, moved = s, time.monotonic()
        elif s and time.monotonic() - moved > stall:
            raise RuntimeError(f"the job stopped at step {s}: {log.read_text()[-800:]}")
        if final(log.read_text(errors="replace")):
            raise RuntimeError("the job ended early")
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no step {n} within {timeout}s: {log.read_text()[-1500:]}")


def nvidia_maps(pid: int | None) -> str:
    """Per process of the job's tree: its mappings of /dev/nvidia* devices
    (what CRIU's handle_device_vma meets if the driver left any)."""
    from collections import Counter

    from smr.process.tree import process_tree

    if not pid:
        return "?"
    out = []
    for p in process_tree(pid):
        try:
            maps = Path(f"/proc/{p}/maps").read_text().splitlines()
            comm = Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            continue
        devs = Counter(ln.split()[-1] for ln in maps if "/dev/nvidia" in ln)
        out.append(f"{p}({comm}): {dict(devs) or '-'}")
    return "; ".join(out)


TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
              "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT",
              "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def addr(hexaddr: str) -> str:
    """/proc/net/tcp's `0100007F:6D7C` as `127.0.0.1:28028` (v6 as hex)."""
    ip, port = hexaddr.split(":")
    if len(ip) == 8:
        ip = ".".join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return f"{ip}:{int(port, 16)}"


def tcp_table(path: Path) -> None:
    """Every TCP socket of the host with its state, ports and holder (pid and
    comm from /proc/*/fd; TIME_WAIT and orphans have none): the machine lacks
    `ss`, and a restore's `Address already in use` needs the port's holder."""
    holders: dict[str, str] = {}
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            comm = (fd_dir.parent / "comm").read_text().strip()
            for fd in fd_dir.iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    holders[link[8:-1]] = f"{fd_dir.parent.name}({comm})"
        except OSError:
            continue
    lines = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            f = row.split()
            local, remote, st, inode = f[1], f[2], f[3], f[9]
            lines.append(f"{table} {TCP_STATES.get(st, st):12} local {addr(local)} "
                         f"remote {addr(remote)}"
                         f" inode {inode} "
                         f"{holders.get(inode, '-')}")
    path.write_text("\n".join(sorted(lines)) + "\n")


def keep_criu_logs(data: Path, out: Path, name: str) -> None:
    """A failed CRIU run's log is kept under the data directory: copy it out
    before the directory goes."""
    if (data / "logs" / "criu").is_dir():
        shutil.copytree(data / "logs" / "criu", out / f"criu-logs-{name}", dirs_exist_ok=True)


def gib(n: int | None) -> str:
    return f"{(n or 0) / 2**30:.2f} GiB"


async def run_one(name: str, cmd: list[str], env: dict[str, str], migrations: int,
                  out: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"workload": name, "cmd": " ".join(cmd[1:]),
                           "env": env, "events": []}
    full_env = {**os.environ, **env}
    t = time.monotonic()
    base = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=400)
    res["baseline_s"] = round(time.monotonic() - t, 1)
    res["baseline"] = final(base.stdout)
    print(f"[{name}] uninterrupted: {res['baseline']} in {res['baseline_s']}s", flush=True)
    if not res["baseline"]:
        res["error"] = f"baseline failed: {(base.stdout + base.stderr)[-2000:]}"
        return res
    data = Path(tempfile.mkdtemp(prefix=f"smr-{name}-", dir="/tmp"))
    s_env = {**full_env, "SMR_DATA_DIR": str(data), "SMR_NODE_NAME": "h100",
             "SMR_ACK_WAIT": "60"}
    up_log = open(out / f"up-{name}.log", "wb")
    up = subprocess.Popen([PY, "-m", "smrctl.cli", "up"], env=s_env, stdout=up_log,
                          stderr=subprocess.STDOUT)
    log = out / f"job-{name}.log"
    try:
        for _ in range(600):
            if (data / "nats.url").exists() and b"Ctrl-C" in (out / f"up-{name}.log").read_bytes():
                break
            await asyncio.sleep(0.1)
        settings = config.load({k: v for k, v in s_env.items() if k.startswith("SMR_")})
        bus = await embedded.connect(settings)
        r = subprocess.run([PY, "-m", "smrctl.cli", "exec", "--gpu", "-i", name, "--log",
                            str(log), "--", *cmd], env=s_env, capture_output=True, text=True)
        print(f"[{name}] {r.stdout.strip()} {r.stderr.strip()}", flush=True)
        at = await wait_step(log, 30, timeout=300)
        m_pid = re.search(r"pid (\d+)", r.stdout)
        pid = int(m_pid.group(1)) if m_pid else None
        print(f"[{name}] nvidia maps at the start: {nvidia_maps(pid)}", flush=True)

        async def ckpt(leave_running: bool) -> CkptDone:
            req = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=name,
                                target=Target.job(name), node="h100", reason="api",
                                leave_running=leave_running)
            done = await bus.request(req, timeout=600)
            assert isinstance(done, CkptDone)
            return done

        done = await ckpt(True)
        ev = {"event": "heartbeat", "status": done.status, "size": gib(done.size_bytes),
              "downtime_s": done.durations.get("downtime"), "durations": done.durations,
              "error": done.error, "step": at}
        res["events"].append(ev)
        print(f"[{name}] heartbeat at step {at}: {done.status} {ev['size']} downtime "
              f"{ev['downtime_s']} {done.error or ''}", flush=True)
        print(f"[{name}] nvidia maps after the heartbeat: {nvidia_maps(pid)}", flush=True)
        for m in range(1, migrations + 1):
            at = await wait_step(log, steps(log) + 10)
            tcp_table(out / f"tcp-{name}-before-migration-{m}.txt")
            t0 = time.monotonic()
            done = await ckpt(False)
            ev = {"event": f"migration {m}", "checkpoint": done.status,
                  "size": gib(done.size_bytes), "ckpt_durations": done.durations,
                  "error": done.error, "step": at}
            res["events"].append(ev)
            if done.status != "succeeded":
                print(f"[{name}] migration {m}: checkpoint failed {done.error}", flush=True)
                print(f"[{name}] nvidia maps now: {nvidia_maps(pid)}", flush=True)
                break
            req = RestoreRequested(request_id=uuid.uuid4().hex, checkpoint_id=name,
                                   target=Target.job(name), node="h100", reason="api")
            rest = await bus.request(req, timeout=600)
            assert isinstance(rest, RestoreDone)
            ev.update(restore=rest.status, restore_durations=rest.durations,
                      downtime_s=round(time.monotonic() - t0, 2),
                      restore_to_running_s=rest.durations.get("total"),
                      restore_error=rest.error)
            print(f"[{name}] migration {m} at step {at}: {done.status}/{rest.status} "
                  f"{ev['size']} downtime {ev['downtime_s']}s restore-to-running "
                  f"{ev['restore_to_running_s']} {rest.error or ''}", flush=True)
            if rest.status != "succeeded":
                tcp_table(out / f"tcp-{name}-after-failed-restore-{m}.txt")
                keep_criu_logs(data, out, name)
                res["final"], res["equal"] = None, False
                return res
            pid = rest.pid or pid
            print(f"[{name}] nvidia maps after the restore: {nvidia_maps(pid)}", flush=True)
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not final(log.read_text(errors="replace")):
            job_alive = subprocess.run([PY, "-m", "smrctl.cli", "ps"], env=s_env,
                                       capture_output=True, text=True).stdout
            if f"{name} " in job_alive and "exited" in job_alive.split(name, 1)[1][:30]:
                break
            await asyncio.sleep(1)
        res["final"] = final(log.read_text(errors="replace"))
        res["equal"] = res["final"] == res["baseline"]
        print(f"[{name}] final {res['final']} equal to uninterrupted: {res['equal']}",
              flush=True)
        await bus.close()
    except Exception as e:  # the log says what failed; the next workload still runs
        res["error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] ERROR {res['error']}", flush=True)
    finally:
        subprocess.run([PY, "-m", "smrctl.cli", "kill", name], env=s_env, capture_output=True)
        up.terminate()
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        keep_criu_logs(data, out, name)
        shutil.rmtree(data, ignore_errors=True)
        print(f"[{name}] job log tail:\n" + "\n".join(
            log.read_text(errors="replace").splitlines()[-6:]) if log.exists() else "", flush=True)
    return res


async def wait_ready(log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and "ready port=" in log.read_text(errors="replace"):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the server never said ready: {log.read_text()[-1500:]}")


async def run_hf(migrations: int, out: Path) -> dict[str, Any]:
    """The Hugging Face server (tests/workloads/hf_generate.py): the answers of
    an uninterrupted server, then under smr up: three prompts before a
    heartbeat, three between it and the first migration, three after each
    restore; every answer's tokens must equal the uninterrupted one's."""
    name, model_dir = "hf-generate", Path(tempfile.mkdtemp(prefix="smr-hf-model-"))
    cmd = [PY, "-m", "tests.workloads.hf_generate", "--dir", str(model_dir)]
    res: dict[str, Any] = {"workload": name, "events": [], "answers": {}}
    base_log = out / "hf-baseline.log"
    with open(base_log, "wb") as f:
        base = subprocess.Popen([*cmd, "--port", "8730"], stdout=f, stderr=subprocess.STDOUT)
    try:
        await wait_ready(base_log, 600)
        want = [await asyncio.to_thread(hf_generate.ask, 8730, p) for p in hf_generate.PROMPTS]
    finally:
        base.kill()
        base.wait()
    print(f"[{name}] uninterrupted answers: {[w[:4] for w in want]}", flush=True)
    data = Path(tempfile.mkdtemp(prefix=f"smr-{name}-", dir="/tmp"))
    s_env = {**os.environ, "SMR_DATA_DIR": str(data), "SMR_NODE_NAME": "h100",
             "SMR_ACK_WAIT": "60"}
    up = subprocess.Popen([PY, "-m", "smrctl.cli", "up"], env=s_env,
                          stdout=open(out / f"up-{name}.log", "wb"), stderr=subprocess.STDOUT)
    log = out / f"job-{name}.log"
    got: dict[int, list[int]] = {}

    async def ask(phase: str, which: range) -> None:
        for i in which:
            got[i] = await asyncio.to_thread(hf_generate.ask, 8731, hf_generate.PROMPTS[i])
            res["answers"][f"{phase}:{i}"] = got[i] == want[i]
        print(f"[{name}] {phase}: equal {[got[i] == want[i] for i in which]}", flush=True)

    try:
        for _ in range(600):
            if (data / "nats.url").exists() and b"Ctrl-C" in (out / f"up-{name}.log").read_bytes():
                break
            await asyncio.sleep(0.1)
        bus = await embedded.connect(config.load(
            {k: v for k, v in s_env.items() if k.startswith("SMR_")}))
        r = subprocess.run([PY, "-m", "smrctl.cli", "exec", "--gpu", "-i", name, "--log",
                            str(log), "--", *cmd, "--port", "8731"], env=s_env,
                           capture_output=True, text=True)
        print(f"[{name}] {r.stdout.strip()} {r.stderr.strip()}", flush=True)
        await wait_ready(log)
        await ask("before the heartbeat", range(0, 3))
        req = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=name,
                            target=Target.job(name), node="h100", reason="api",
                            leave_running=True)
        done = await bus.request(req, timeout=600)
        assert isinstance(done, CkptDone)
        res["events"].append({"event": "heartbeat", "status": done.status,
                              "size": gib(done.size_bytes), "durations": done.durations,
                              "error": done.error})
        print(f"[{name}] heartbeat: {done.status} {gib(done.size_bytes)} downtime "
              f"{done.durations.get('downtime')} {done.error or ''}", flush=True)
        await ask("between the heartbeat and the migration", range(3, 6))
        for m in range(1, migrations + 1):
            t0 = time.monotonic()
            done = await bus.request(CkptRequested(
                request_id=uuid.uuid4().hex, checkpoint_id=name, target=Target.job(name),
                node="h100", reason="api", leave_running=False), timeout=600)
            assert isinstance(done, CkptDone)
            ev: dict[str, Any] = {"event": f"migration {m}", "checkpoint": done.status,
                                  "size": gib(done.size_bytes), "error": done.error}
            res["events"].append(ev)
            if done.status != "succeeded":
                print(f"[{name}] migration {m}: checkpoint failed {done.error}", flush=True)
                break
            rest = await bus.request(RestoreRequested(
                request_id=uuid.uuid4().hex, checkpoint_id=name, target=Target.job(name),
                node="h100", reason="api"), timeout=600)
            assert isinstance(rest, RestoreDone)
            ev.update(restore=rest.status, downtime_s=round(time.monotonic() - t0, 2),
                      restore_to_running_s=rest.durations.get("total"), error=rest.error)
            print(f"[{name}] migration {m}: {done.status}/{rest.status} {ev['size']} downtime "
                  f"{ev['downtime_s']}s restore-to-running {ev['restore_to_running_s']} "
                  f"{rest.error or ''}", flush=True)
            if rest.status != "succeeded":
                tcp_table(out / f"tcp-{name}-after-failed-restore-{m}.txt")
                keep_criu_logs(data, out, name)
                res["final"], res["equal"] = None, False
                return res
            await ask(f"after restore {m}", range(6, 9))
        res["equal"] = bool(res["answers"]) and all(res["answers"].values())
        print(f"[{name}] every answer equal to the uninterrupted server's: {res['equal']}",
              flush=True)
        await bus.close()
    except Exception as e:  # the log says what failed
        res["error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] ERROR {res['error']}", flush=True)
    finally:
        subprocess.run([PY, "-m", "smrctl.cli", "kill", name], env=s_env, capture_output=True)
        up.terminate()
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        shutil.rmtree(data, ignore_errors=True)
        shutil.rmtree(model_dir, ignore_errors=True)
    return res


def throughput(out: Path, steps: int = 400, width: int = 4096) -> dict[str, Any]:
    """Steps per second of the DDP loop between checkpoints (no sleep, a
    wider model), three ways in one call: no smr at all (plain torchrun,
    NCCL's own P2P); started as `smr exec --gpu` starts it (smr.process.reaper, its
    seccomp filter) with the cooperative library and its directory; the same
    without the library over sockets only (NCCL_P2P_DISABLE=1
    NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0), what a job without the library needs to
    migrate."""
    ddp = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "tests.workloads.ddp_train", "--steps", str(steps), "--interval", "0",
           "--width", str(width)]
    coop_dir = Path(tempfile.mkdtemp(prefix="smr-coop-"))
    reaper = [PY, "-m", "smr.process.reaper", "--"]
    ways = {
        "no smr, P2P": (ddp, {}),
        "smr, cooperative library, P2P": (reaper + ddp + ["--coop"],
                                          {"SMR_COOP_DIR": str(coop_dir)}),
        "smr, sockets only": (reaper + ddp, {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1",
                                               "NCCL_NVLS_ENABLE": "0"}),
    }
    res: dict[str, Any] = {"workload": "ddp-throughput", "steps": steps, "width": width}
    for rnd in range(2):  # interleaved, twice: each way's two rates
        for way, (cmd, env) in ways.items():
            r = subprocess.run(cmd, env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                                         **env}, capture_output=True, text=True, timeout=300)
            rate = next((ln.split()[0][5:] for ln in r.stdout.splitlines()
                         if ln.startswith("rate=")), None)
            res.setdefault(way, []).append(float(rate) if rate else None)
            print(f"[throughput] round {rnd + 1} {way}: {rate} steps/s "
                  f"{'' if rate else (r.stdout + r.stderr)[-1500:]}", flush=True)
    shutil.rmtree(coop_dir, ignore_errors=True)
    return res


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--migrations", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--throughput", action="store_true",
                    help="DDP steps/s: no smr, the cooperative library, sockets only")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.throughput:
        print("RESULT " + json.dumps(throughput(out)), flush=True)
    for name, (cmd, env) in WORKLOADS.items():
        if a.only and name not in a.only:
            continue
        res = await run_one(name, cmd, env, a.migrations, out)
        print("RESULT " + json.dumps(res), flush=True)
    if a.only and "hf-generate" in a.only:  # only when named: it needs transformers
        print("RESULT " + json.dumps(await run_hf(a.migrations, out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
