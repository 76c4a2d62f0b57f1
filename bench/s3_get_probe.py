"""What limits GETs from `rclone serve s3` (and moto's server), apart from
smr: objects like a template's (``--objects`` of ``--mib`` MiB, random
bytes) uploaded with boto3, then read as a restore reads them (8 MiB ranged
GETs, 16 at a time, over all objects; and one whole-object GET per object, 4
at a time), the first read of each object and again. rclone computes an
object's ETag (MD5) on its first read; ``--etag-hash ''`` turns that off.
Last, whole reads by a boto3 client that checks the CRC32 a server returns
(boto3's default; the others check none).

    python3 bench/s3_get_probe.py [--objects 16] [--mib 128] [--servers rclone,rclone-no-etag,moto]

On the GPU machine: rclone and boto3 from .device/s3.tar.xz (unpacked into
/tmp/site, its smr-rclone/ on PATH); moto's server also needs the wheels of
.whl (scripts/device-s3-stage.sh installs both).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RANGE = 8 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server(kind: str, port: int, data: Path) -> subprocess.Popen[bytes]:
    if kind.startswith("rclone"):
        exe = shutil.which("rclone", path=str(Path(sys.executable).parent)) or "rclone"
        extra = ["--etag-hash", ""] if kind == "rclone-no-etag" else []
        cmd = [exe, "serve", "s3", "--addr", f"127.0.0.1:{port}",
               "--auth-key", "testing,testing", *extra, str(data)]
    else:
        cmd = [sys.executable, str(Path(__file__).parent / "s3server.py"), "-H", "127.0.0.1",
               "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{kind} did not start")


def probe(kind: str, objects: int, mib: int) -> dict[str, float]:
    import boto3
    from botocore.config import Config

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    data = Path(tempfile.mkdtemp(prefix="s3probe-", dir="/var/tmp"))
    port = free_port()
    proc = server(kind, port, data)
    try:
        # No checksums computed or checked on this side (boto3's default
        # checks a CRC32 the server returns, on this machine's CPU): the
        # server's speed; whole4_crc is the default client's, for comparison.
        def client(checks: str) -> object:
            return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}",
                                config=Config(s3={"addressing_style": "path"},
                                              max_pool_connections=32,
                                              request_checksum_calculation=checks,
                                              response_checksum_validation=checks))
        s3: Any = client("when_required")
        checked: Any = client("when_supported")
        s3.create_bucket(Bucket="probe")
        size = mib << 20
        body = os.urandom(size)
        keys = [f"o{i}" for i in range(objects)]
        total = size * objects
        out: dict[str, float] = {}
        for label in ("a", "b"):  # two sets: one read ranged first, one whole first
            t = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda k, p=label: s3.put_object(Bucket="probe", Key=f"{p}{k}",
                                                               Body=body), keys))
            out[f"put_{label}"] = total / 1e9 / (time.monotonic() - t)

        def ranged(key: str, start: int) -> int:
            end = min(start + RANGE, size) - 1
            return len(s3.get_object(Bucket="probe", Key=key, Range=f"bytes={start}-{end}")
                       ["Body"].read())

        def whole(key: str, c: Any = None) -> int:
            b, got = (c or s3).get_object(Bucket="probe", Key=key)["Body"], 0
            while chunk := b.read(RANGE):
                got += len(chunk)
            return got

        def ranged_all(prefix: str) -> float:
            jobs = [(f"{prefix}{k}", s) for k in keys for s in range(0, size, RANGE)]
            t = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                assert sum(pool.map(lambda j: ranged(*j), jobs)) == total
            return total / 1e9 / (time.monotonic() - t)

        def whole_all(prefix: str, c: Any = None) -> float:
            t = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                assert sum(pool.map(lambda k: whole(k, c), [f"{prefix}{k}" for k in keys])) \
                    == total
            return total / 1e9 / (time.monotonic() - t)

        out["ranged16_first"] = ranged_all("a")
        out["ranged16_again"] = ranged_all("a")
        out["whole4_first"] = whole_all("b")
        out["whole4_again"] = whole_all("b")
        out["ranged16_after_whole"] = ranged_all("b")
        out["whole4_crc"] = whole_all("b", checked)
        return out
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=16)
    ap.add_argument("--mib", type=int, default=128)
    ap.add_argument("--servers", default="rclone,rclone-no-etag,moto")
    a = ap.parse_args()
    print(f"{a.objects} objects of {a.mib} MiB, random bytes; GB/s = 10^9 bytes/s; "
          f"{os.cpu_count()} cores")
    cols = ["put_a", "ranged16_first", "ranged16_again", "whole4_first", "whole4_again",
            "ranged16_after_whole", "whole4_crc"]
    print(f"  {'server':<16}" + "".join(f"{c:>22}" for c in cols))
    for kind in a.servers.split(","):
        r = probe(kind, a.objects, a.mib)
        print(f"  {kind:<16}" + "".join(f"{r[c]:>17.2f} GB/s" for c in cols), flush=True)


if __name__ == "__main__":
    main()
