"""The CPU the tests' S3 server (tests/moto_s3.py) spends on a request, this
tree's beside another's in one run:

    .venv/bin/python bench/moto_requests.py [--base DIR] [--requests 400] [--rounds 3]

``--base DIR``: a checkout of the commit to compare with (``git worktree add
--detach DIR REV``). Each tree's server runs as the tests start it, and the
two take turns in rounds, so that a change in the machine's load falls on
both. A round sends ``--requests`` small requests of the kinds a checkpoint
makes (PUT, HEAD, GET, a listing) through boto3, signed as the product signs
them, and reads the server's CPU time from /proc before and after. Printed per
tree: the server's CPU milliseconds per request (median of the rounds)."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import boto3
from botocore.config import Config

HERE = Path(__file__).resolve().parent.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _server(tree: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    proc = subprocess.Popen([sys.executable, str(tree / "tests" / "moto_s3.py"),
                             "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tree)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise SystemExit(f"the S3 server of {tree} did not listen on port {port}")
    return proc, f"http://127.0.0.1:{port}"


def one_round(tree: Path, requests: int) -> float:
    """Milliseconds of the server's CPU per request."""
    proc, url = _server(tree)
    try:
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench",
                          config=Config(retries={"max_attempts": 1}))
        s3.create_bucket(Bucket="bench")
        before = _cpu_s(proc.pid)
        for i in range(requests // 4):
            key = f"ckpt/{i % 50}/manifest.json"
            s3.put_object(Bucket="bench", Key=key, Body=b"x" * 512)
            s3.head_object(Bucket="bench", Key=key)
            s3.get_object(Bucket="bench", Key=key)["Body"].read()
            s3.list_objects_v2(Bucket="bench", Prefix=f"ckpt/{i % 50}/")
        return (_cpu_s(proc.pid) - before) / (requests // 4 * 4) * 1000
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, help="a checkout to compare with")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    trees = {"this": HERE, **({"base": args.base.resolve()} if args.base else {})}
    ms: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            ms[name].append(one_round(tree, args.requests))
    for name, values in ms.items():
        print(f"{name:5} {trees[name]}: {statistics.median(values):.2f} ms of server CPU "
              f"a request (rounds: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
