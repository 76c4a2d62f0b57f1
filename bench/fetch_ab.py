"""The download path of two commits side by side: fetch time and the reader's peak memory.

One image set (a page image of memory-like, compressible bytes and one of
random bytes) is committed once to moto's S3 server over HTTP. Then each
commit's code fetches it (download, decode, verify every byte's sha256, write
to disk) in a fresh process, taking turns for ``--rounds`` rounds: the
machine's speed drifts, the turns share it. The base commit is checked out in
a temporary git worktree.

    .venv/bin/python bench/fetch_ab.py --base c30f877 [--mib 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from statistics import median

from services.storage.codec import Codec
from services.storage.s3 import S3Backend
from services.storage.store import CheckpointStore
from smr.contract.messages import Target
from smr.natsserver import free_port

REPO = Path(__file__).resolve().parent.parent
NS, CKPT = "bench", "fetch"

FETCH = r"""
import asyncio, resource, sys, time
from pathlib import Path
from services.storage.codec import Codec
from services.storage.s3 import S3Backend
from services.storage.store import CheckpointStore

async def main(endpoint, bucket, dst):
    store = CheckpointStore(S3Backend(bucket, prefix="smr", endpoint_url=endpoint,
                                      path_style=True), Codec(level=3))
    gen = await store.get("bench", "fetch", 1)
    t0 = time.monotonic()
    await store.fetch(gen, Path(dst))
    took = time.monotonic() - t0
    await store.close()
    print(took, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)

asyncio.run(main(*sys.argv[1:]))
"""


def memory_like(mib: int) -> bytes:
    line = b"step=000123 loss=0.0421 lr=3e-4 weights=[0.5, 0.25, 0.125] grad_norm=1.07\n"
    return b"".join((line.replace(b"000123", b"%06d" % i) * 14000)[: 1 << 20]
                    for i in range(mib))


async def commit(endpoint: str, bucket: str, src: Path) -> int:
    b = S3Backend(bucket, prefix="smr", endpoint_url=endpoint, path_style=True)
    async with b._client() as c:
        await c.create_bucket(Bucket=bucket)
    store = CheckpointStore(b, Codec(level=3))
    gen = await store.commit(NS, CKPT, src, {
        "request_id": "bench", "node": "bench", "reason": "api",
        "target": Target.job(CKPT).to_dict(), "versions": {"criu": "bench"}})
    await store.close()
    return int(gen.manifest["stored_bytes"])


def fetch(tree: Path, endpoint: str, bucket: str, dst: Path) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", FETCH, endpoint, bucket, str(dst)], env=env,
                         cwd=tree, capture_output=True, text=True, check=False)
    if out.returncode:
        sys.exit(f"fetch with {tree} failed: {out.stderr[-800:]}")
    took, rss = out.stdout.split()
    return float(took), int(rss)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the commit to compare with (git rev)")
    ap.add_argument("--mib", type=int, default=512, help="MiB of each page image")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="benchsecret",
                      AWS_DEFAULT_REGION="us-east-1")  # moto takes any
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="smr-fetch-ab-") as tmp:
        work = Path(tmp)
        base = work / "base"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(base), a.base],
                       cwd=REPO, check=True)
        port = free_port()
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p",
             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            endpoint, bucket = f"http://127.0.0.1:{port}", f"ab-{uuid.uuid4().hex[:8]}"
            time.sleep(2)
            src = work / "src" / "images"
            src.mkdir(parents=True)
            (src / "pages-1.img").write_bytes(memory_like(a.mib))
            (src / "pages-2.img").write_bytes(os.urandom(a.mib << 20))
            stored = asyncio.run(commit(endpoint, bucket, src.parent))
            times: dict[str, list[float]] = {"base": [], "head": []}
            rss: dict[str, list[int]] = {"base": [], "head": []}
            for r in range(a.rounds):
                for name, tree in (("base", base), ("head", REPO)):
                    dst = work / f"out-{name}-{r}"
                    t, m = fetch(tree, endpoint, bucket, dst)
                    times[name].append(t)
                    rss[name].append(m)
                    subprocess.run(["rm", "-rf", str(dst)], check=True)
        finally:
            server.terminate()
            server.wait()
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO,
                           check=False)
    total = 2 * a.mib
    print(f"fetch of {total} MiB ({a.mib} memory-like + {a.mib} random; "
          f"{stored / (1 << 20):.0f} MiB stored), moto over HTTP, {a.rounds} rounds in turns")
    print(f"{'':6} {'commit':>9} {'median s':>9} {'MiB/s':>7} {'peak RSS MiB':>13}  all s")
    for name, rev in (("base", a.base), ("head", head)):
        t = median(times[name])
        print(f"{name:6} {rev:>9} {t:9.2f} {total / t:7.0f} {max(rss[name]):13d}  "
              + " ".join(f"{x:.2f}" for x in times[name]))


if __name__ == "__main__":
    main()
