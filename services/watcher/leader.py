"""Leader election through a coordination.k8s.io Lease (kubernetes-asyncio's
LeaderElection and LeaseLock), so only one watcher replica runs the heartbeat
schedule. The election's writes are conditional on the Lease's
resourceVersion, so two candidates never both win a round.

``lead`` runs while this replica leads and is cancelled when the Lease is lost;
the replica then goes back to competing. A replica that stops gracefully
hands the Lease back (empty holder), so the next one need not wait it out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.leaderelection import electionconfig, leaderelection
from kubernetes_asyncio.leaderelection.resourcelock.leaselock import LeaseLock

log = logging.getLogger("smr.watcher.leader")


class Leadership:
    def __init__(self, api: client.ApiClient, *, namespace: str, name: str, identity: str,
                 lease_s: float, renew_s: float, retry_s: float,
                 lead: Callable[[], Awaitable[None]]) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        # Whole seconds: the Lease stores leaseDurationSeconds as an integer
        # (and the library's LeaseLock calls int() on the string of a float).
        self.lease_s = max(2, math.ceil(lease_s))
        self.renew_s, self.retry_s = renew_s, max(1.0, retry_s)
        self.lead = lead
        self.leading = asyncio.Event()
        self.terms = 0
        self._lead_task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        try:
            while True:
                election = leaderelection.LeaderElection(electionconfig.Config(
                    LeaseLock(self.name, self.namespace, self.identity, self.api),
                    lease_duration=self.lease_s, renew_deadline=self.renew_s,
                    retry_period=self.retry_s, onstarted_leading=self._leading,
                    onstopped_leading=self._stopped))
                await election.run()  # returns when a held Lease was lost
        finally:
            # The library runs ``lead`` as a task of its own and cancels it
            # only when the Lease is lost, not when the election is cancelled.
            if self._lead_task is not None:
                self._lead_task.cancel()
                with contextlib.suppress(BaseException):
                    await self._lead_task

    async def _leading(self) -> None:
        self._lead_task = asyncio.current_task()
        self.terms += 1
        self.leading.set()
        log.info("%s leads (Lease %s/%s)", self.identity, self.namespace, self.name)
        await self.lead()

    async def _stopped(self) -> None:
        self.leading.clear()
        log.warning("%s lost the Lease %s/%s", self.identity, self.namespace, self.name)

    async def release(self) -> None:
        """Give the Lease back if this replica holds it."""
        self.leading.clear()
        api = client.CoordinationV1Api(self.api)
        with contextlib.suppress(ApiException):
            lease = await api.read_namespaced_lease(self.name, self.namespace)
            if lease.spec and lease.spec.holder_identity == self.identity:
                lease.spec.holder_identity = None
                await api.replace_namespaced_lease(self.name, self.namespace, lease)
                log.info("%s released the Lease", self.identity)
