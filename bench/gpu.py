"""GPU checkpoint and restore timings on a real GPU, each beside its reference.

For each size, a PyTorch job (tests.workloads.gpu_counter) holds that many GiB
on the GPU, and in the same run:

  baseline   driver lock+checkpoint, CRIU dump to disk, then upload (no
             compression); time-to-durable = all three
  heartbeat  driver lock+checkpoint, CRIU dump to RAM streamed to storage
             while it is written (zstd); the job is restored and unlocked as
             soon as the dump is in (the upload goes on behind it); downtime
             is lock to unlock. Once into a tmpfs with transparent huge pages
             (where one can be mounted), once into /dev/shm.
  floors     what the hardware allows for each part of the freeze: pinned
             PCIe copies of the GPU bytes (D2H for the driver checkpoint, H2D
             for its restore), memcpy of the image's bytes (all cores, one core)
  restore    the job killed; the reference: fetch into RAM, then CRIU restore
             from RAM + driver restore; then smr's restore: CRIU restores while
             the images stream from storage (services/restorer/stream), driver
             restore + unlock; restore-to-running until it runs again, checked
             by its next lines (ok=True, same fingerprint)

Storage is the local backend on the machine's disk (no S3 server reaches
the GPU machine). Targets (issue #16): restore-to-running <= 1.3 x (CRIU
restore from RAM + driver restore); heartbeat downtime <= 0.5 x the
2026-11-21 figure; time-to-durable <= 1.15 x (driver checkpoint + dump).

    python3 bench/gpu.py [--gib 4 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from services.restorer.stream import restore_streamed
from services.storage.codec import Codec
from services.storage.generation import Generation
from services.storage.local import LocalBackend
from services.storage.store import CheckpointStore
from smr import config
from smr.contract.messages import Target
from smr.gpu import gpuinfo
from smr.gpu.cuda_checkpoint import CudaCheckpoint
from smr.jobs import Job, launch, proc_start_ticks, wait_exit
from smr.process.criu import Criu, CriuRun

# Heartbeat downtime measured before this issue (bench/results/gpu-h100-2026-11-21.txt).
PR_SET_CHILD_SUBREAPER = 36
TODAY_DOWNTIME = {4.0: 6.76, 16.0: 20.19}
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
    job = launch(tag, [sys.executable, "-m", "tests.workloads.gpu_counter", "--gib", str(gib),
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
    huge = await huge_tmpfs()
    if huge:  # first, so that the generation restored below is the /dev/shm one
        hb = await heartbeat(cuda, criu, store, pid, huge / "work-stream", tag, gib)
        r.update(dump_huge=hb["dump"], downtime_huge=hb["downtime"])
        await store.delete_checkpoint("bench", tag)
        await (await asyncio.create_subprocess_exec("umount", str(huge))).wait()
        await wait_lines(job, len(lines(job)) + 2, pid)
    hb = await heartbeat(cuda, criu, store, pid, RAM / "work-stream", tag, gib)
    gen = hb.pop("gen")
    r.update(hb)
    await wait_lines(job, len(lines(job)) + 2, pid)

    # -- restore-to-running: CRIU from RAM (the reference), then streamed --------
    os.kill(pid, 9)
    await wait_exit(pid, job.start_ticks, timeout=60)
    work = RAM / "work-restore"
    t0 = time.monotonic()
    await store.fetch(gen, work)
    r["fetch"] = time.monotonic() - t0
    new_pid, run, rr = await restore_once(criu, cuda, job, work, None)
    r.update(criu_restore=run.seconds, restore_driver=rr.get("cuda_restore", 0.0))
    r["intact"] = await check_and_kill(job, new_pid, fp0)
    shutil.rmtree(work)

    work = RAM / "work-stream-restore"
    streamed: dict[str, float] = {}
    t0 = time.monotonic()
    new_pid, run, rr = await restore_once(criu, cuda, job, work, (store, gen, streamed))
    r.update(restore_to_running=time.monotonic() - t0, streamed_criu=run.seconds,
             streamed_download=streamed["download"],
             streamed_driver=rr.get("cuda_restore", 0.0))
    r["intact"] = min(r["intact"], await check_and_kill(job, new_pid, fp0))
    shutil.rmtree(work, ignore_errors=True)
    await store.delete_checkpoint("bench", tag)
    return r


async def heartbeat(cuda: CudaCheckpoint, criu: Criu, store: CheckpointStore, pid: int,
                    work: Path, tag: str, gib: float) -> dict[str, Any]:
    """Driver checkpoint, CRIU dump into ``work`` uploaded while written, the
    job resumed (driver restore, unlock) as soon as the dump is in: a heartbeat."""
    r: dict[str, Any] = {}
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
             image_gib=gen.manifest["size_bytes"] / 2**30, gen=gen)
    shutil.rmtree(work)
    return r


async def restore_once(criu: Criu, cuda: CudaCheckpoint, job: Job, work: Path,
                       stream: tuple[CheckpointStore, Generation, dict[str, float]] | None
                       ) -> tuple[int, CriuRun, dict[str, float]]:
    """CRIU restore (from ``work``'s files, or streamed from storage), then the
    driver restore and unlock: the process runs again."""
    work.mkdir(parents=True, exist_ok=True)
    fd = os.open(job.log, os.O_WRONLY | os.O_APPEND)
    try:
        if stream:
            store, gen, durations = stream
            run = await restore_streamed(criu, store, gen, work / "images", durations,
                                         pidfile=work / "pid", inherit={job.log: fd},
                                         tcp="close")
        else:
            run = await criu.restore(work / "images", pidfile=work / "pid",
                                     inherit={job.log: fd})
    finally:
        os.close(fd)
    new_pid = int((work / "pid").read_text())
    return new_pid, run, await cuda.resume(new_pid)


async def check_and_kill(job: Job, pid: int, fp0: str) -> float:
    """1.0 when the restored job goes on with its tensors intact; then it is
    killed (and gone: the next restore needs its PID)."""
    seen = len(lines(job))
    await wait_lines(job, seen + 2, pid)
    after = lines(job)[seen:]
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    os.kill(pid, 9)
    # Reaped (this process is the subreaper of what CRIU restores), and every
    # thread gone: the next restore needs all of its PIDs free.
    with contextlib.suppress(ChildProcessError):
        await asyncio.to_thread(os.waitpid, pid, 0)
    deadline = time.monotonic() + 120
    while any(os.path.exists(f"/proc/{t}") for t in tids):
        if time.monotonic() > deadline:
            sys.exit(f"the restored job {pid} did not exit")
        await asyncio.sleep(0.05)
    return float(all(ln["ok"] == "True" and ln["fp"] == fp0 for ln in after))


FLOORS = r"""
import sys, time, torch
gib, image_gib = float(sys.argv[1]), float(sys.argv[2])
n, m = int(gib * 2**30), int(image_gib * 2**30)
dev = torch.empty(n, dtype=torch.uint8, device="cuda")
host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
torch.cuda.synchronize()
t = time.perf_counter(); host.copy_(dev); torch.cuda.synchronize(); d2h = time.perf_counter() - t
t = time.perf_counter(); dev.copy_(host); torch.cuda.synchronize(); h2d = time.perf_counter() - t
del dev, host
a = torch.ones(m, dtype=torch.uint8); b = torch.zeros(m, dtype=torch.uint8)
t = time.perf_counter(); b.copy_(a); par = time.perf_counter() - t
torch.set_num_threads(1)
t = time.perf_counter(); a.copy_(b); one = time.perf_counter() - t
print(d2h, h2d, par, one)
"""


async def floors(gib: float, image_gib: float) -> dict[str, float]:
    """What the hardware allows for each part of a heartbeat's freeze: pinned
    PCIe copies of the GPU bytes each way, and memcpy of the image's bytes
    (all cores, and one core as CRIU's dump uses)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FLOORS, str(gib), str(image_gib),
        stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    d2h, h2d, par, one = (float(x) for x in out.split())
    return {"floor_d2h": d2h, "floor_h2d": h2d, "floor_memcpy": par, "floor_memcpy_1": one}


async def huge_tmpfs() -> Path | None:
    """A tmpfs with transparent huge pages for a second heartbeat's dump;
    None where it cannot be mounted."""
    path = Path("/mnt/smr-bench-huge")
    path.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        "mount", "-t", "tmpfs", "-o", "huge=always,size=100G", "tmpfs", str(path))
    return path if await proc.wait() == 0 else None


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[4, 16])
    a = ap.parse_args()
    s = config.load()
    criu = Criu(s.criu_binary())
    # Restored jobs (CRIU detaches them) become this process's children, so
    # that a killed one is reaped here: GPU jobs keep their host PIDs (the
    # driver does not start in a PID namespace), and the next restore needs
    # the PIDs free. The machine's PID 1 may never reap them.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    cuda = CudaCheckpoint()
    for p in (DISK, RAM):
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
    print(f"GPU {gpuinfo.devices()[0]['model']}, driver {gpuinfo.versions()}, "
          f"THP {gpuinfo.thp_mode()}, {os.cpu_count()} cores", flush=True)
    results = {}
    for gib in a.gib:
        results[gib] = await one_size(gib, criu, cuda)
        results[gib].update(await floors(gib, results[gib]["image_gib"]))
        print(f"{gib:g} GiB: " + ", ".join(f"{k}={v:.2f}" for k, v in results[gib].items()),
              flush=True)
    print("\nseconds         " + "".join(f"{g:>10g} GiB" for g in a.gib))
    rows = [
        ("driver ckpt", "driver_ckpt"), ("  floor: pinned D2H", "floor_d2h"),
        ("CRIU dump (RAM)", "dump"), ("CRIU dump (huge tmpfs)", "dump_huge"),
        ("  floor: memcpy", "floor_memcpy"), ("  floor: memcpy 1 core", "floor_memcpy_1"),
        ("driver restore", "driver_restore"), ("  floor: pinned H2D", "floor_h2d"),
        ("baseline dump(disk)", "base_dump"), ("baseline upload", "base_upload"),
        ("durable baseline", "base_durable"), ("durable streamed", "durable"),
        ("downtime (beat)", "downtime"), ("downtime (huge tmpfs)", "downtime_huge"),
        ("fetch to RAM", "fetch"), ("CRIU restore (RAM)", "criu_restore"),
        ("driver restore", "restore_driver"),
        ("restore streamed: CRIU", "streamed_criu"),
        ("  images all in at", "streamed_download"),
        ("restore-to-running", "restore_to_running"),
    ]
    for label, k in rows:
        print(f"{label:24}" + "".join(f"{results[g].get(k, float('nan')):14.2f}"
                                     for g in a.gib))
    print()
    for g in a.gib:
        x = results[g]
        goal_d = 1.15 * (x["driver_ckpt"] + x["dump"])
        goal_r = 1.3 * (x["criu_restore"] + x["restore_driver"])
        before = TODAY_DOWNTIME.get(g)
        beat = min(x["downtime"], x.get("downtime_huge", x["downtime"]))
        print(f"{g:g} GiB: durable {x['durable']:.2f}s vs target {goal_d:.2f}s "
              f"({'met' if x['durable'] <= goal_d else 'MISSED'}); restore-to-running "
              f"{x['restore_to_running']:.2f}s vs target {goal_r:.2f}s = 1.3 x (CRIU restore "
              f"from RAM + driver restore) "
              f"({'met' if x['restore_to_running'] <= goal_r else 'MISSED'})"
              + (f"; downtime {beat:.2f}s vs target {before / 2:.2f}s = 0.5 x {before:.2f}s "
                 f"({'met' if beat <= before / 2 else 'MISSED'})" if before else "")
              + f"; stored {x['stored_gib']:.2f} of {x['image_gib']:.2f} GiB; "
              f"tensors intact after both restores: {bool(x['intact'])}")

if __name__ == "__main__":
    asyncio.run(main())
