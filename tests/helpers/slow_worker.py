"""A worker process for the crash test: its step writes a marker file per
execution, then sleeps, so the test can SIGKILL it mid-step.

    python -m tests.helpers.slow_worker NATS_URL NODE MARKER_DIR SLEEP_S
        [MAX_DELIVER [rerun|cutoff]]

With ``rerun`` its recover() says the step is safe to run again. With
``cutoff`` NATS is away for its beats (neither heartbeats nor in_progress get
through; JetStream and the KV are up for the rest), as for a worker cut off.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from smr.bus import Bus, BusConfig, Progress, Worker
from smr.contract.messages import CkptDone, CkptRequested
from tests.helpers.steplocks import node_locks


class SlowStep:
    kind = "ckpt.requested"

    def __init__(self, marker_dir: Path, sleep: float, rerun: bool) -> None:
        self.marker_dir = marker_dir
        self.sleep = sleep
        self.rerun = rerun

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        n = len(list(self.marker_dir.glob(f"{req.request_id}.*")))
        (self.marker_dir / f"{req.request_id}.{n}").write_text("executed")
        progress.update("sleeping")
        await asyncio.sleep(self.sleep)
        return CkptDone.for_request(req, status="succeeded", generation=1)

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        if self.rerun:
            return None
        # This step's side effect is not safe to repeat: report the interruption.
        return CkptDone.for_request(req, status="failed", error={
            "code": "interrupted", "message": f"attempt by {state['owner']} was interrupted"})


async def main() -> None:
    url, node, marker_dir, sleep = sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
    max_deliver = int(sys.argv[5]) if len(sys.argv) > 5 else 4
    rerun = sys.argv[6:7] == ["rerun"]
    if sys.argv[6:7] == ["cutoff"]:
        async def no_beats(self: Worker, *a: Any) -> None:
            await asyncio.Event().wait()

        async def lost(self: Any) -> None:
            pass

        Worker._keepalive = no_beats  # type: ignore[method-assign]
        Msg.in_progress = lost  # type: ignore[method-assign]
    bus = await Bus.connect(url, config=BusConfig(max_deliver=max_deliver, ack_wait=1.0))
    print("ready", flush=True)
    await Worker(bus, SlowStep(marker_dir, sleep, rerun), node, service="slow",
                 locks=node_locks(node)).run()


if __name__ == "__main__":
    asyncio.run(main())
