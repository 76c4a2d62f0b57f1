"""smr's side of the cooperative path (smr/coop.py holds the ranks' side):
before the GPU lock, the ranks of a job that imported ``smr.coop`` are asked
to drop their NCCL communicators at a step boundary, and the gate lets their
P2P through once every one of them has acknowledged.

Where no acknowledgement comes within the deadline the request is withdrawn
and the checkpoint refused (``coop-no-ack``) with nothing frozen: a rank
that paused builds its process group again and the job runs on.

The directory is the job's own, and what the ranks write there is theirs:
only a rank file naming a process of the job's tree, written under that
process's PID, counts, and an acknowledgement lifts the P2P refusal for that
job alone (a forged one puts only its own job's GPU state at stake, as
``SMR_GPU_ALLOW`` would).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from pathlib import Path

from smr.gpu.coopproto import ENV, REQUEST, ack_file, rank_file, read_json, write_json
from smr.gpu.gpugate import GateRefused, comm

__all__ = ["ENV", "directory", "pause", "ranks", "release"]


def directory(work_path: Path, job_id: str) -> Path:
    """The job's cooperation directory: given to it as SMR_COOP_DIR at its start."""
    return work_path / "coop" / job_id


def ns_pid(pid: int) -> int | None:
    """``pid`` as the process itself knows it (its innermost PID namespace's
    number: a job of `smr exec` runs in its own), or None when gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (OSError, ValueError):
        return None
    return pid


def ranks(d: Path, tree: Collection[int]) -> dict[int, int]:
    """The processes of ``tree`` that registered as cooperative ranks: each
    one's PID here → the PID it wrote its files under."""
    out = {}
    for pid in tree:
        own = ns_pid(pid)
        info = read_json(rank_file(d, own)) if own is not None else None
        if info is not None and info.get("pid") == own:
            out[pid] = own
    return out


async def pause(d: Path, tree: Collection[int], request_id: str, deadline_s: float) -> list[int]:
    """Ask the job's cooperative ranks to pause; the ranks that acknowledged
    (every one of them), or [] for a job without any. Refused, the request
    withdrawn, where one does not answer within ``deadline_s``."""
    want = ranks(d, tree)
    if not want:
        return []
    write_json(d / REQUEST, {"id": request_id})
    deadline = time.monotonic() + deadline_s
    while True:
        missing = [p for p, own in sorted(want.items())
                   if (read_json(ack_file(d, own)) or {}).get("id") != request_id]
        if not missing:
            return sorted(want)
        gone = [p for p in missing if comm(p) == "gone"]
        if gone or time.monotonic() > deadline:
            release(d)
            why = (f"rank process {', '.join(map(str, gone))} ended" if gone else
                   f"rank {', '.join(f'{p} ({comm(p)})' for p in missing)} did not acknowledge "
                   f"within {deadline_s:.0f} s")
            raise GateRefused(
                f"the job's cooperative ranks were asked to release their NCCL communicators "
                f"at a step boundary and {why}; the request was withdrawn, nothing was "
                "frozen, the job runs on", code="coop-no-ack",
                hint="a rank acknowledges at the end of an optimizer step: a step longer "
                     "than the deadline, or a loop without torch.optim, never does "
                     "(docs/gpu.md, the cooperative path)")
        await asyncio.sleep(0.05)


def release(d: Path) -> None:
    """Let the ranks go on: they build their process group again. Idempotent."""
    (d / REQUEST).unlink(missing_ok=True)
