#!/usr/bin/env python3
"""Runs test files N times under a CPU hog on every core and reports each
test's pass rate: a test whose timing a loaded machine does not keep shows
up here before CI meets it.

    scripts/test-stress.py [-n N] [--hogs K] [-k EXPR] FILE_OR_NODE...

Each run is one pytest process writing JUnit XML (pytest's own report); the
hogs are busy-looping processes started here, each bounded by `timeout`, and
ended (by their own ids) when the runs are over."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

# Files whose tests start real programs or run timed stand-ins: the first
# suspects when a loaded machine fails a test that passes alone.
DEFAULT_FILES = ["tests/test_gpu_peers.py", "tests/test_spawn_semaphore.py",
                 "tests/test_criu_timeout.py", "tests/test_reaping.py"]


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed / failed / skipped, the failure's message), from
    one run's JUnit XML."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = [c for c in case if c.tag in ("failure", "error")]
        kind = ("failed" if bad else
                "skipped" if any(c.tag == "skipped" for c in case) else "passed")
        out[name] = (kind, (bad[0].get("message") or "")[:300] if bad else "")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", default=DEFAULT_FILES)
    ap.add_argument("-n", type=int, default=10, help="runs of each file (default 10)")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 2,
                    help="busy-looping processes (default: one a core)")
    ap.add_argument("-k", default="", help="pytest -k expression")
    ap.add_argument("--run-timeout", type=int, default=900, help="seconds a run may take")
    args = ap.parse_args()

    # A stop from outside (make's timeout, a ^C) still ends the hogs below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bound = args.n * args.run_timeout + 60  # the hogs end by themselves, whatever happens here
    hogs = [subprocess.Popen(["timeout", str(bound), sys.executable, "-c", "while 1: pass"])
            for _ in range(args.hogs)]
    results: dict[str, list[str]] = defaultdict(list)
    unreported = 0
    try:
        with tempfile.TemporaryDirectory(prefix="smr-stress-") as d:
            for i in range(1, args.n + 1):
                junit = Path(d) / f"run{i}.xml"
                cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                       f"--junitxml={junit}", *(["-k", args.k] if args.k else []), *args.files]
                t0 = time.monotonic()
                try:
                    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        timeout=args.run_timeout).returncode
                except subprocess.TimeoutExpired:
                    rc = -1
                took = time.monotonic() - t0
                got = outcomes(junit) if junit.exists() else {}
                unreported += not got
                for name, (outcome, _) in got.items():
                    results[name].append(outcome)
                failed = sorted(f"{n}: {m}" for n, (o, m) in got.items() if o == "failed")
                passed = sum(o == "passed" for o, _ in got.values())
                print(f"run {i}/{args.n}: rc={rc} {passed} passed, {len(failed)} failed "
                      f"in {took:.1f}s under {args.hogs} hogs"
                      + "".join(f"\n    FAILED {n}" for n in failed)
                      + ("" if got else "\n    no report: the run timed out or crashed"),
                      flush=True)
    finally:
        for h in hogs:
            h.terminate()
            h.wait()
    print("\npass rate per test:")
    flaky = 0
    for name, outs in sorted(results.items()):
        ran = [o for o in outs if o != "skipped"]
        ok = sum(o == "passed" for o in ran)
        flaky += ok < len(ran)
        print(f"  {ok}/{len(ran)}  {name}" + (f"  ({len(outs) - len(ran)} skipped)"
                                              if len(ran) < len(outs) else ""))
    return 1 if flaky or unreported or not results else 0


if __name__ == "__main__":
    sys.exit(main())
