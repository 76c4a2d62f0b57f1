"""Nothing lost in a pod: a final checkpoint of a pod whose storage stays down
past SMR_COMMIT_DEADLINE (the local-job step holds its job stopped and lets it
run on; docs/reliability.md promises the same)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from services.checkpointer.pod import PodCheckpointStep
from services.storage.backend import StorageError
from smr.contract.messages import CkptRequested, Target
from tests.agent.cluster import Cluster, steps, store_puts_through, workload
from tests.helpers.live import live


async def test_a_final_pod_checkpoint_that_cannot_be_stored_loses_no_state(
        cluster: Cluster) -> None:
    """Storage fails past the client's retries after the dump, until the
    commit deadline passes: the request fails. The workload's state must
    survive somewhere: the workload running on where it was, or its dump
    kept for a later commit. (At 382babe CRIU killed the workload at the dump
    and the step deleted the dump: the state was gone.)"""
    a, _ = list(cluster.kubelets)
    env = {"SMR_CHECKPOINT": "held-1"}
    cluster.kube.put("pods", workload("held", a, env=env, owner="train", restart="Never"))
    await cluster.until_steps("held", a, 5)
    for o in live(PodCheckpointStep):  # the agents' steps: a short deadline for the test
        o.commit_deadline = 4.0

    async def failing(real: Any, key: str, data: bytes, **kw: Any) -> str:
        if key.endswith("manifest.json"):
            raise StorageError(f"injected: S3 500 on {key}", hint="a test fault")
        return str(await real(key, data, **kw))

    with store_puts_through(cluster, failing):
        done = await cluster.bus.request(CkptRequested(
            request_id=uuid.uuid4().hex, checkpoint_id="held-1", node=a,
            target=Target(kind="pod", namespace="default", pod="held", container="main")),
            timeout=120)
    assert done.status == "failed", done
    assert done.error and done.error["code"] == "storage-unavailable", done.error
    at = len(steps(cluster.log("held", a)))
    await asyncio.sleep(3)
    ran_on = len(steps(cluster.log("held", a))) > at
    assert ran_on, (f"the checkpoint failed ({done.error['message']}) and the workload no "
                    f"longer runs: CRIU ended it at the dump, and the dump was deleted "
                    f"(t={time.time():.0f})")
