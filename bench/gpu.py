"""GPU checkpoint timings on a real GPU: streamed pipeline vs sequential baseline.

For each size, a PyTorch job (smr.workloads.gpu_counter) holds that many GiB
on the GPU, and in the same run:

  baseline   driver lock+checkpoint, CRIU dump to disk, then upload (no
             compression); time-to-durable = all three
  streamed   driver lock+checkpoint, CRIU dump to RAM (/dev/shm) streamed to
             storage while it is written (zstd); the job is restored and
             unlocked as soon as the dump sits in RAM (a heartbeat), the upload
             goes on behind it; time-to-durable and downtime (wall clock, lock
             to unlock)
  restore    the job killed, then fetch + CRIU restore + driver restore +
             unlock until it runs again (restore-to-running), checked by its
             next lines (ok=True, same fingerprint)

Storage is the local backend on the machine's disk (no S3 server reaches
the GPU machine). Targets (issue #7): time-to-durable <= 1.15 x (driver
checkpoint + dump); downtime <= driver checkpoint + dump + driver restore + 0.5 s.

    python3 bench/gpu.py [--gib 4 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from services.storage.codec import Codec
from services.storage.local import LocalBackend
from services.storage.store import CheckpointStore
from smr import config, gpuinfo
from smr.criu import Criu
from smr.cuda_checkpoint import CudaCheckpoint
from smr.jobs import Job, launch, proc_start_ticks, wait_exit
from smr.messages import Target

DISK = Path(os.environ.get("BENCH_DISK", "/var/tmp/smr-bench-gpu"))
RAM = Path(os.environ.get("BENCH_RAM", "/dev/shm/smr-bench-gpu"))


def lines(job: Job) -> list[dict[str, str]]:
    out = []
    for ln in Path(job.log).read_text().splitlines():
        if ln.startswith("step="):
            out.append(dict(p.split("=", 1) for p in ln.split()))
    return out


async def wait_lines(job: Job, n: int, pid: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(lines(job)) < n:
        if time.monotonic() > deadline or proc_start_ticks(pid) is None:
            sys.exit(f"job stalled or died: {Path(job.log).read_text()[-1500:]}")
        await asyncio.sleep(0.05)


def meta(gib: float) -> dict[str, object]:
    return {"request_id": uuid.uuid4().hex, "node": "bench", "reason": "heartbeat",
            "target": Target.job("bench").to_dict(), "versions": {"criu": "4.1.1"}}


async def one_size(gib: float, criu: Criu, cuda: CudaCheckpoint) -> dict[str, float]:
    r: dict[str, float] = {}
    tag = f"gpu{gib:g}-{uuid.uuid4().hex[:4]}"
    job = launch(tag, [sys.executable, "-m", "smr.workloads.gpu_counter", "--gib", str(gib),
                       "--interval", "0.05"], log=DISK / f"{tag}.log", cwd=DISK, node="bench",
                 own_pid_namespace=False)
    await wait_lines(job, 3, job.pid)
    fp0 = lines(job)[0]["fp"]
    pid = job.pid

    # -- baseline: checkpoint, dump to disk, then upload -------------------------
    plain = CheckpointStore(LocalBackend(DISK / "store"), Codec(level=0))
    work = DISK / "work-base"
    t0 = time.monotonic()
    await cuda.suspend(pid)
    t1 = time.monotonic()
    dump = await criu.dump(pid, work / "images", leave_running=True)
    t2 = time.monotonic()
    await cuda.resume(pid)
    t3 = time.monotonic()
    await plain.commit("bench", tag + "-base", work, meta(gib))
    t4 = time.monotonic()
    r.update(base_driver_ckpt=t1 - t0, base_dump=dump.seconds, base_upload=t4 - t3,
             base_durable=(t2 - t0) + (t4 - t3))
    shutil.rmtree(work)
    await plain.delete_checkpoint("bench", tag + "-base")
    await wait_lines(job, len(lines(job)) + 2, pid)

    # -- streamed heartbeat: dump to RAM, upload while written, resume at once --
    store = CheckpointStore(LocalBackend(DISK / "store"), Codec(level=3))
    work = RAM / "work-stream"
    t0 = time.monotonic()
    d = await cuda.suspend(pid)
    t1 = time.monotonic()
    dump_task = asyncio.create_task(criu.dump(pid, work / "images", leave_running=True))

    async def resume_after_dump() -> float:
        await asyncio.wait([dump_task])
        rr = await cuda.resume(pid)
        r["driver_restore"] = rr.get("cuda_restore", 0.0)
        return time.monotonic()

    resumed = asyncio.create_task(resume_after_dump())
    gen = await store.commit("bench", tag, work, meta(gib), writer=dump_task)
    t_durable = time.monotonic()
    t_unlocked = await resumed
    r.update(driver_lock=d["cuda_lock"], driver_ckpt=t1 - t0, dump=dump_task.result().seconds,
             durable=t_durable - t0, downtime=t_unlocked - t0,
             stored_gib=gen.manifest["stored_bytes"] / 2**30,
             image_gib=gen.manifest["size_bytes"] / 2**30)
    shutil.rmtree(work)
    await wait_lines(job, len(lines(job)) + 2, pid)

    # -- restore-to-running from storage -------------------------------------
    os.kill(pid, 9)
    await wait_exit(pid, job.start_ticks, timeout=60)
    seen = len(lines(job))
    t0 = time.monotonic()
    work = RAM / "work-restore"
    await store.fetch(gen, work)
    t1 = time.monotonic()
    fd = os.open(job.log, os.O_WRONLY | os.O_APPEND)
    try:
        run = await criu.restore(work / "images", pidfile=work / "pid", inherit={job.log: fd})
    finally:
        os.close(fd)
    new_pid = int((work / "pid").read_text())
    rr = await cuda.resume(new_pid)
    t2 = time.monotonic()
    r.update(fetch=t1 - t0, criu_restore=run.seconds, restore_driver=rr.get("cuda_restore", 0),
             restore_to_running=t2 - t0)
    await wait_lines(job, seen + 2, new_pid)
    after = lines(job)[seen:]
    r["intact"] = float(all(ln["ok"] == "True" and ln["fp"] == fp0 for ln in after))
    os.kill(new_pid, 9)
    shutil.rmtree(work)
    await store.delete_checkpoint("bench", tag)
    return r


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[4, 16])
    a = ap.parse_args()
    s = config.load()
    criu = Criu(s.criu_binary())
    cuda = CudaCheckpoint()
    for p in (DISK, RAM):
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
    print(f"GPU {gpuinfo.devices()[0]['model']}, driver {gpuinfo.versions()}, "
          f"THP {gpuinfo.thp_mode()}, {os.cpu_count()} cores", flush=True)
    results = {}
    for gib in a.gib:
        results[gib] = await one_size(gib, criu, cuda)
        print(f"{gib:g} GiB: " + ", ".join(f"{k}={v:.2f}" for k, v in results[gib].items()),
              flush=True)
    print("\nseconds         " + "".join(f"{g:>10g} GiB" for g in a.gib))
    rows = [
        ("driver ckpt", "driver_ckpt"), ("CRIU dump (RAM)", "dump"),
        ("baseline dump(disk)", "base_dump"), ("baseline upload", "base_upload"),
        ("durable baseline", "base_durable"), ("durable streamed", "durable"),
        ("downtime (beat)", "downtime"), ("driver restore", "driver_restore"),
        ("restore-to-running", "restore_to_running"),
    ]
    for label, k in rows:
        print(f"{label:20}" + "".join(f"{results[g][k]:14.2f}" for g in a.gib))
    print()
    for g in a.gib:
        x = results[g]
        goal_d = 1.15 * (x["driver_ckpt"] + x["dump"])
        goal_h = x["driver_ckpt"] + x["dump"] + x["driver_restore"] + 0.5
        print(f"{g:g} GiB: durable {x['durable']:.2f}s vs target {goal_d:.2f}s "
              f"({'met' if x['durable'] <= goal_d else 'MISSED'}); baseline/streamed "
              f"{x['base_durable'] / x['durable']:.2f}x; downtime {x['downtime']:.2f}s vs "
              f"target {goal_h:.2f}s ({'met' if x['downtime'] <= goal_h else 'MISSED'}); "
              f"stored {x['stored_gib']:.2f} of {x['image_gib']:.2f} GiB; "
              f"tensors intact after restore: {bool(x['intact'])}")


if __name__ == "__main__":
    asyncio.run(main())
