"""`smr demo`: the main job, end to end through NATS, CRIU and storage.

Starts a sample job holding memory and a counter, checkpoints it (which stops
it), restores it, and checks from its own output that it continued at the next
step with its memory intact. Uses the running `smr up` if there is one,
otherwise runs an embedded node for the demo's duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from services.storage.layout import LOCAL_NAMESPACE
from services.storage.settings import make_store
from smr.bus import KV_JOBS, Bus
from smr.config import Settings
from smr.contract.errors import SmrError
from smr.contract.messages import CkptRequested, RestoreDone, RestoreRequested, Target
from smr.jobs import JobRegistry, job_key, launch, proc_start_ticks
from smrctl import demo_counter as counter
from smrctl import embedded, reach


def say(msg: str) -> None:
    print(msg, flush=True)


def last_step(log: Path) -> dict[str, str] | None:
    lines = [counter.parse_line(ln) for ln in log.read_text().splitlines() if "step=" in ln]
    return lines[-1] if lines else None


async def wait_steps(log: Path, at_least: int, pid: int, timeout: float = 60) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and (ln := last_step(log)) and int(ln["step"]) >= at_least:
            return ln
        if proc_start_ticks(pid) is None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
            raise SmrError(f"the sample job (pid {pid}) died; its log ends:\n{tail}")
        await asyncio.sleep(0.1)
    raise SmrError(f"the sample job did not reach step {at_least} in {timeout}s; see {log}")


async def run_demo(s: Settings, *, mib: int = 256, keep: bool = False) -> int:
    node = None
    try:
        bus = await reach.connect(s)
    except SmrError:
        say("smr is not running here: starting an embedded node for the demo")
        node = await embedded.EmbeddedNode(s).start()
        bus = node.bus
        assert bus is not None
    try:
        return await _demo(s, bus, mib, keep)
    finally:
        if node:
            await node.stop()
        else:
            await bus.close()


async def _demo(s: Settings, bus: Bus, mib: int, keep: bool) -> int:
    jobs = JobRegistry(bus.kv(KV_JOBS), job_key(s.job_key_path))
    job_id = f"demo-{uuid.uuid4().hex[:6]}"
    jobs.check_writable(job_id)
    log = (s.data_path / "logs" / f"{job_id}.log").resolve()
    cmd = [sys.executable, "-m", "smrctl.demo_counter", "--mib", str(mib)]
    job = launch(job_id, cmd, log=log, cwd=Path.cwd(), node=s.node)
    await jobs.put(job)
    say(f"1. started job {job_id} (pid {job.pid}) holding {mib} MiB; log {log}")
    before = await wait_steps(log, 3, job.pid)
    say(f"   it counts: step {before['step']}, memory digest {before['digest']}")

    say("2. checkpoint (ckpt.requested → checkpointer → CRIU dump → storage → ckpt.done)")
    req = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=job_id,
                        target=Target.job(job_id), node=s.node)
    done = await bus.request(req, timeout=600)
    if done.status != "succeeded":
        raise SmrError(f"checkpoint failed: {(done.error or {}).get('message')}")
    frozen = last_step(log)
    assert frozen is not None
    # `durable`: from the dump's start to the committed manifest (the upload
    # overlaps the dump, so there is no separate upload time).
    say(f"   generation {done.generation}: {done.size_bytes / 2**20:.0f} MiB, dump "
        f"{done.durations.get('dump', 0):.2f}s, stored {done.durations.get('durable', 0):.2f}s "
        "after the dump began (the upload overlaps it)")
    say(f"   the job stopped at step {frozen['step']}; process {job.pid} is "
        f"{'still there?!' if job.alive() else 'gone'}")
    await asyncio.sleep(1.0)

    say("3. restore (restore.requested → restorer → CRIU restores as the images stream in, "
        "sha256-checked)")
    rreq = RestoreRequested(request_id=uuid.uuid4().hex, checkpoint_id=job_id,
                            target=Target.job(job_id), node=s.node)
    rdone = await bus.request(rreq, timeout=600)
    assert isinstance(rdone, RestoreDone)
    if rdone.status != "succeeded":
        raise SmrError(f"restore failed: {(rdone.error or {}).get('message')}")
    say(f"   restored as pid {rdone.pid} in {rdone.durations.get('total', 0):.2f}s")
    after = await wait_steps(log, int(frozen["step"]) + 2, rdone.pid or 0)

    steps = [counter.parse_line(ln) for ln in log.read_text().splitlines() if "step=" in ln]
    resumed = next(ln for ln in steps[steps.index(frozen) + 1:])
    want = counter.expected_digest(mib, int(resumed["step"]))
    ok = int(resumed["step"]) == int(frozen["step"]) + 1 and resumed["digest"] == want
    say(f"4. it continued: step {frozen['step']} → {resumed['step']} (not 1), "
        f"digest {resumed['digest']} {'==' if resumed['digest'] == want else '!='} "
        f"recomputed {want}; now at step {after['step']}")
    with contextlib.suppress(ProcessLookupError):
        os.kill(rdone.pid or 0, signal.SIGKILL)
    if keep:
        say(f"   kept: `smr checkpoints {job_id}` lists its checkpoint, `smr ps` its job")
    else:
        await make_store(s).delete_checkpoint(LOCAL_NAMESPACE, job_id)
        await jobs.delete(job_id)
        log.unlink(missing_ok=True)
        say("   cleaned up its checkpoint, log and job record (--keep keeps them)")
    say("demo " + ("passed: the process resumed where it stopped, state intact"
                   if ok else "FAILED: the restored process did not continue its state"))
    return 0 if ok else 1
