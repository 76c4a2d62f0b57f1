"""PreStop hooks no final checkpoint will answer: released at once.

The watcher asks for a final checkpoint of a pod being deleted only when a
disruption deletes it (services/triggers: ``final_expected``): an eviction
through the Eviction API (``kubectl drain``, the descheduler), scheduler
preemption, the taint manager, each marking the pod ``DisruptionTarget``
before its deletion, or its Job being suspended (services/suspension). A
plain ``kubectl delete`` of an opted-in pod gets none, wherever it runs,
and its preStop hook (``smr-init --wait-final``) would wait its whole time
(60 s by default) before the kubelet's SIGTERM.
The agent sees each hook that waits (its ``waiter`` file in smr-init's
directory) and, for a pod being deleted with no final checkpoint coming
(its node read afresh), writes ``final``: ``none ...``. The hook prints it
and returns.

A graceful node shutdown deletes no pod (no ``deletionTimestamp``): its
hooks wait. A container held for a dump (``hold``) is never released here:
that dump's outcome answers it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
from kubernetes_asyncio.client.exceptions import ApiException

from services.agent.starts import _claim
from services.containers import host
from services.containers.confined import UnsafePath
from services.containers.host import Shim
from services.containers.pods import Pods
from services.suspension import suspension_of
from services.triggers import final_expected
from smr.aio import wait_event
from smr.contract.errors import SmrError
from smr.jobs import proc_start_ticks

log = logging.getLogger("smr.agent")

SCAN_S = 0.5
# A hook found waiting and left so (its pod not deleted, or a final checkpoint
# coming) is looked at again after this: a `waiter` file the workload made
# itself costs the API one list of the node's pods per RECHECK_S, no more.
RECHECK_S = 5.0
NONE = "none: no final checkpoint is asked for (the pod is deleted, not evicted or preempted)"


class PreStopWaits:
    def __init__(self, pods: Pods, node: str, extra_taints: tuple[str, ...]) -> None:
        self.pods = pods
        self.node = node
        self.extra_taints = extra_taints
        self._released: set[tuple[int, int]] = set()  # shims (pid, start) answered
        self._checked: dict[tuple[int, int], float] = {}  # shim → when last looked at

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.scan()
            except SmrError as e:  # the API away: asked again next scan
                log.warning("preStop hooks: %s", e.message)
            except Exception:
                log.exception("preStop hooks: scan failed")
            await wait_event(stop, SCAN_S)

    async def scan(self) -> None:
        hooks = await asyncio.to_thread(_waiting)
        now = time.monotonic()
        # Forget containers gone or answered.
        self._released &= {k for k, _ in hooks}
        self._checked = {k: t for k, t in self._checked.items() if k in {h for h, _ in hooks}}
        waiting = [(k, s) for k, s in hooks if k not in self._released
                   and now - self._checked.get(k, -RECHECK_S) >= RECHECK_S]
        if not waiting:
            return
        pods = await self.pods.on_node()
        self._checked.update((k, now) for k, _ in waiting)
        read = False
        node: dict[str, Any] | None = None
        for key, shim in waiting:
            found = _claim(pods, host.container_id_of(shim.pid) or "")
            if found is None or not found[0]["metadata"].get("deletionTimestamp"):
                continue  # not this node's, or not being deleted: not ours to answer
            pod = found[0]
            if not read:  # once a scan, and only for a pod being deleted
                node, read = await self._node(), True
            if final_expected(pod, node, self.extra_taints):
                continue
            # Deleted by its suspended Job (a queue's preemption): the watcher
            # asks for its final checkpoint. Read fresh: raises if the Job
            # cannot be read, and the hook is looked at again next scan.
            if await suspension_of(self.pods.core.api_client, pod) is not None:
                continue
            log.info("pod %s/%s is deleted on node %s, not by a disruption: its preStop "
                     "hook waits for no final checkpoint", pod["metadata"]["namespace"],
                     pod["metadata"]["name"], self.node)
            await asyncio.to_thread(shim.final, NONE)
            self._released.add(key)

    async def _node(self) -> dict[str, Any] | None:
        """This node as the API server has it now (a watch could lag behind the
        cordon that came before the eviction); None once it is deleted."""
        try:
            resp = await self.pods.core.read_node(self.node, _preload_content=False,
                                                  _request_timeout=10)
        except ApiException as e:
            if e.status == 404:
                return None
            raise SmrError(f"cannot read node {self.node}: {e.reason}",
                           code="kube-api") from None
        return orjson.loads(await resp.read())  # type: ignore[no-any-return]


def _waiting() -> list[tuple[tuple[int, int], Shim]]:
    """The shims whose preStop hook waits for a final checkpoint not yet
    reported, and not held for a dump (every file is the tenant's: read
    confined; one refused counts as not waiting)."""
    out = []
    for shim in host.shims(max_age=host.SCAN_MAX_AGE_S):
        try:
            with shim.confined() as root:
                root.read(f"{shim.dir}/waiter")
                for absent in ("final", "hold"):
                    try:
                        root.read(f"{shim.dir}/{absent}")
                    except FileNotFoundError:
                        continue
                    break
                else:
                    out.append(((shim.pid, proc_start_ticks(shim.pid) or 0), shim))
        except (OSError, UnsafePath):
            continue
    return out
