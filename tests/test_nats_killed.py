"""The bus's steps against a real nats-server killed with SIGKILL and
started again on the same store directory and port, at the worst moment of a
final checkpoint: its dump stored, its job held stopped, nothing of it yet
in NATS (the registry's record, the step's result). NATS stays away past the
step's own retries (retry_nats, ~21 s of waits).

What a user relies on: the request is answered once, as succeeded, with the
generation stored before NATS went; nothing is dumped twice (the job is gone
by then); the job runs nowhere until restored, and its restore goes on from
the step it was frozen at.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from smr.bus.topology import STREAM_EVENTS, subject
from smr.contract.messages import CkptDone, CkptRequested, Target
from tests import nats_auth
from tests.test_bus import stored
from tests.test_local_smr import Harness, running
from tests.test_step_recovery_faults import copies

DOWN_S = 30.0  # past retry_nats's ~21 s of waits


async def step_result(h: Harness, rid: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # NATS away, or the client reconnecting
            state, _ = await h.bus.step_state(rid)
            if state and state.get("state") in ("done", "failed"):
                return state
        await asyncio.sleep(0.5)
    raise AssertionError(f"request {rid} never answered")


@pytest.mark.criu
async def test_nats_killed_after_a_final_dump_was_stored_answers_it_once(
        criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
        ) -> None:
    srv = nats_users.server  # killed and started again, with its users
    try:
        async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0) as h:
            job = await h.start(64)
            step = h.node.workers[0].step
            store = step.store
            real = store.commit
            killed: list[int] = []
            restarted = asyncio.Event()

            async def restart() -> None:
                await asyncio.sleep(DOWN_S)
                await asyncio.to_thread(srv.start)
                restarted.set()

            async def commit(*a: Any, **kw: Any) -> Any:
                gen = await real(*a, **kw)
                if not killed:
                    assert srv.proc is not None
                    srv.proc.kill()  # SIGKILL: nothing of it flushed or said
                    srv.proc.wait()
                    killed.append(gen.number)
                    asyncio.get_running_loop().create_task(restart())
                return gen

            store.commit = commit  # type: ignore[method-assign]
            rid = uuid.uuid4().hex
            await h.bus.publish(CkptRequested(request_id=rid, checkpoint_id=job.id,
                                              target=Target.job(job.id), node=node))
            state = await step_result(h, rid, timeout=180)
            store.commit = real  # type: ignore[method-assign]
            assert killed, "the fault never fired"
            assert restarted.is_set()
            result = state["result"]
            assert state["state"] == "done", (
                f"the final checkpoint stored as generation {killed[0]} before NATS went "
                f"was answered {state['state']}: {result.get('error')}")
            assert result["generation"] == killed[0]
            gens = await store.generations("local", job.id)
            assert [g.number for g in gens] == killed, f"dumped again: {gens}"
            assert copies(h.tmp) == [], "the job still runs after its final checkpoint"
            answers = await stored(h.bus, subject("ckpt.done", node, "local"), STREAM_EVENTS,
                                   CkptDone, wait=2)
            mine = [a for a in answers if a.request_id == rid]
            assert len(mine) == 1 and mine[0].status == "succeeded", mine
            frozen = int(h.lines(job)[-1]["step"])
            done = await h.restore(job.id)
            assert done.status == "succeeded", done.error
            await h.wait_step(job, frozen + 2)
            after = [int(ln["step"]) for ln in h.lines(job) if int(ln["step"]) > frozen]
            assert after[0] == frozen + 1, f"went on from step {after[0]}, frozen at {frozen}"
    finally:
        srv.stop()


@pytest.mark.criu
async def test_nats_killed_as_a_heartbeat_dump_begins_never_leaves_the_job_frozen(
        criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
        ) -> None:
    """A heartbeat (leave-running) checkpoint; NATS is killed as CRIU freezes
    the job and stays away past the step's retries. The job must run on
    through the outage (its thaw waits on nothing of NATS), and the request
    is answered once NATS is back, from the one dump taken."""
    srv = nats_users.server  # killed and started again, with its users
    try:
        async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0) as h:
            job = await h.start(64)
            before = copies(h.tmp)
            step = h.node.workers[0].step
            real = step.criu.dump
            dumps: list[float] = []
            restarted = asyncio.Event()

            async def restart() -> None:
                await asyncio.sleep(DOWN_S)
                await asyncio.to_thread(srv.start)
                restarted.set()

            async def dump(*a: Any, **kw: Any) -> Any:
                dumps.append(time.monotonic())
                if len(dumps) == 1:
                    assert srv.proc is not None
                    srv.proc.kill()
                    srv.proc.wait()
                    asyncio.get_running_loop().create_task(restart())
                return await real(*a, **kw)

            step.criu.dump = dump  # type: ignore[method-assign]
            rid = uuid.uuid4().hex
            await h.bus.publish(CkptRequested(request_id=rid, checkpoint_id=job.id,
                                              target=Target.job(job.id), node=node,
                                              leave_running=True))
            deadline = time.monotonic() + 30
            while not dumps:
                assert time.monotonic() < deadline, "the dump never began"
                await asyncio.sleep(0.1)
            await asyncio.sleep(3)  # the dump of 64 MiB is over by then
            at = int(h.lines(job)[-1]["step"])
            await h.wait_step(job, at + 20, timeout=15)  # it runs while NATS is away
            assert not restarted.is_set(), "NATS was back already: the outage was not tried"
            state = await step_result(h, rid, timeout=180)
            step.criu.dump = real  # type: ignore[method-assign]
            assert state["state"] == "done", state["result"].get("error")
            gens = await step.store.generations("local", job.id)
            assert len(dumps) == 1 and len(gens) == 1, f"dumped {len(dumps)} times: {gens}"
            assert copies(h.tmp) == before, "the job does not run once, as before"
            at = int(h.lines(job)[-1]["step"])
            await h.wait_step(job, at + 5)
    finally:
        srv.stop()
