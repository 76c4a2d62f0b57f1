"""A CRIU run that outlives its timeout is killed with everything it started.

CRIU runs behind another command (the node agent's nsenter, which forks it
into the container's PID namespace): killing that command alone left CRIU
running, holding the tree frozen or restoring it beside a fresh start.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from smr.contract.errors import TemporaryError
from smr.process.criu import Criu

# A STAND-IN for CRIU (no real CRIU hangs on demand): it ignores SIGTERM,
# starts a helper of its own, says its PIDs and waits forever.
STANDIN = """#!/bin/sh
trap '' TERM
sleep 1000 &
echo "$$ $!" > {pids}
wait
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


async def test_a_timeout_kills_criu_behind_its_prefix(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    standin = tmp_path / "criu-standin"
    standin.write_text(STANDIN.format(pids=pids))
    standin.chmod(0o755)
    # Like nsenter: the prefix forks CRIU and waits for it, it does not exec it.
    criu = Criu(str(standin), timeout=1.0, prefix=["sh", "-c", '"$@"; :', "prefix"])
    with pytest.raises(TemporaryError, match="did not finish within"):
        await criu.dump(1, tmp_path / "images")
    assert pids.is_file(), "the stand-in never ran"
    left = [int(p) for p in pids.read_text().split()]
    for _ in range(100):  # SIGKILL is delivered at once; reaping may lag
        if all(_gone(p) for p in left):
            break
        await asyncio.sleep(0.1)
    alive = [p for p in left if not _gone(p)]
    for p in alive:
        os.kill(p, 9)  # not left behind on this machine whatever the result
    assert not alive, f"CRIU (stand-in) and its helper outlived the timeout: {alive}"
