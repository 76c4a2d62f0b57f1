# ruff: noqa: ASYNC220, ASYNC222 - a probe: nothing else runs beside it
"""Why does a restored JAX process die? (issue #26; run on the GPU machine.)

Drives the same steps as a local GPU job's checkpoint and restore (the
driver's lock + checkpoint, CRIU dump, CRIU restore, the driver's restore +
unlock) by hand, as this process's own children (it is a child subreaper, so
it can tell how the restored process ended), and prints at each step the
process's CUDA state, its threads, and at the end its wait status, its log's
tail and CRIU's log's tail.

    python3 bench/jax_probe.py [--env K=V ...] [--] [workload args]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from smr.gpu import frozen
from smr.gpu.cuda_checkpoint import CudaCheckpoint
from smr.process.criu import Criu


def threads(pid: int) -> str:
    try:
        names = [(Path(f"/proc/{pid}/task/{t}/comm").read_text().strip())
                 for t in os.listdir(f"/proc/{pid}/task")]
    except OSError as e:
        return f"(gone: {e})"
    return f"{len(names)} threads: {sorted(set(names))}"


def wchans(pid: int) -> list[str]:
    out = []
    for t in frozen.threads(pid)[:12]:
        try:
            out.append(Path(f"/proc/{pid}/task/{t}/wchan").read_text())
        except OSError:
            out.append("?")
    return out


def status(pid: int) -> str:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
        return st[st.rindex(")") + 2:].split()[0]
    except OSError:
        return "gone"


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--out", default="/tmp/jaxprobe")
    ap.add_argument("--module", default="tests.workloads.jax_mlp")
    ap.add_argument("--wait-step", type=int, default=20)
    ap.add_argument("--frozen", action="store_true",
                    help="restore as smr does: CRIU leaves it stopped, the driver restores "
                         "it with only its restore thread running (smr.gpu.frozen), then SIGCONT")
    ap.add_argument("rest", nargs="*")
    a = ap.parse_args()
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    for kv in a.env:
        k, _, v = kv.partition("=")
        env[k] = v
    log = out / "job.log"
    with open(log, "wb") as f:
        job = subprocess.Popen([sys.executable, "-m", a.module, *a.rest], stdout=f,
                               stderr=subprocess.STDOUT, env=env, start_new_session=True,
                               stdin=subprocess.DEVNULL)
    pid = job.pid
    t0 = time.monotonic()
    while f"step={a.wait_step} " not in log.read_text():
        if job.poll() is not None:
            print("job died before the checkpoint:", log.read_text()[-3000:])
            return 1
        if time.monotonic() - t0 > 300:
            print("no step", a.wait_step, log.read_text()[-3000:])
            return 1
        await asyncio.sleep(0.2)
    print(f"[{time.monotonic() - t0:.1f}s] pid {pid} at step {a.wait_step}: {threads(pid)}")
    cuda = CudaCheckpoint(lock_timeout_s=10)
    pids = await cuda.processes(pid)
    print("cuda processes:", pids, [await cuda.state(p) for p in pids])
    print("suspend:", await cuda.suspend_all(pids), [await cuda.state(p) for p in pids])
    maps = Path(f"/proc/{pid}/maps").read_text()
    print("device mappings left:", [ln for ln in maps.splitlines() if "/dev/nvidia" in ln][:10])
    fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    print("fds:", sorted(fds))
    criu = Criu(os.environ.get("SMR_CRIU", "criu"))
    images = out / "images"
    run = await criu.dump(pid, images)
    size = sum(p.stat().st_size for p in images.iterdir()) / 2**30
    print(f"dump {run.seconds:.2f}s; image {size:.2f} GiB")
    print("original ended:", job.wait())
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    pidfile = out / "restored.pid"
    criu.timeout = 90
    try:
        run = await criu.restore(images, pidfile=pidfile, inherit={str(log): fd},
                                 leave_stopped=a.frozen)
    except Exception as e:
        print("criu restore failed:", e, getattr(e, "detail", ""))
        tail = (images / "restore.log").read_text(errors="replace").splitlines()[-30:]
        print("--- restore.log tail\n" + "\n".join(tail))
        return 1
    finally:
        os.close(fd)
    rpid = int(pidfile.read_text())
    print(f"restore {run.seconds:.2f}s, pid {rpid}: {threads(rpid)}; states "
          f"{sorted(set(frozen.state(t) for t in frozen.threads(rpid)))}", flush=True)

    async def timed(what: str, fn: Any, *args: Any, limit: float = 30) -> Any:
        t = time.monotonic()
        try:
            r = await asyncio.wait_for(asyncio.to_thread(fn, *args), limit)
            print(f"{what}: {r} ({time.monotonic() - t:.2f}s)", flush=True)
            return r
        except Exception as e:
            print(f"{what}: {type(e).__name__} {e} after {time.monotonic() - t:.2f}s; "
                  f"thread states {[(t, frozen.state(t)) for t in frozen.threads(rpid)][:8]}; "
                  f"wchan {wchans(rpid)}", flush=True)
            return None

    try:
        if a.frozen:
            st = await timed("cuCheckpointProcessGetState (stopped)", cuda.drv.state, rpid)
            tid = await timed("cuCheckpointProcessGetRestoreThreadId (stopped)",
                              cuda.drv.restore_tid, rpid)
            if tid:
                print("restore thread", tid, Path(f"/proc/{rpid}/task/{tid}/comm").read_text())
                await timed("with_only(driver restore + unlock)", frozen.with_only, rpid, tid,
                            lambda: cuda._resume(rpid), limit=60)
            os.kill(rpid, signal.SIGCONT)
            print("SIGCONT sent; cuda state", await timed("state", cuda.drv.state, rpid))
        else:
            print("resume:", await cuda.resume_all(await cuda.processes(rpid)))
    except Exception as e:
        print("cuda resume failed:", type(e).__name__, e)
    for _ in range(100):
        got, st = os.waitpid(rpid, os.WNOHANG)
        if got:
            how = (f"killed by {signal.Signals(os.WTERMSIG(st)).name}" if os.WIFSIGNALED(st)
                   else f"exited {os.WEXITSTATUS(st)}")
            print("restored process ended:", how)
            break
        await asyncio.sleep(0.1)
    else:
        print("restored process still running:", status(rpid), threads(rpid))
    print("--- job log tail\n" + "\n".join(log.read_text().splitlines()[-15:]))
    rl = (images / "restore.log").read_text(errors="replace").splitlines()
    print("--- restore.log errors/warnings\n" + "\n".join(
        ln for ln in rl if "Error" in ln or "Warn" in ln or "fail" in ln.lower())[-4000:])
    print("--- restore.log tail\n" + "\n".join(rl[-25:]))
    # Let an alive one finish, to compare with an uninterrupted run.
    for _ in range(600 if "jax" in a.module else 10):
        if "final=" in log.read_text():
            break
        try:
            got, _ = os.waitpid(rpid, os.WNOHANG)
        except ChildProcessError:
            break
        if got:
            break
        await asyncio.sleep(0.5)
    print("--- final:", [ln for ln in log.read_text().splitlines() if ln.startswith("final=")])
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
