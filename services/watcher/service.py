"""The watcher: turns what happens in the cluster into checkpoint and restore
requests, exactly once in effect, whatever the API server or its own
replicas do.

    Node cordoned / preemption taint / deleted ──▶ node.draining.<node>
                                                  ckpt.requested.<node>.<ns> per opted-in container
    opted-in pod terminating on such a node   ──▶ ckpt.requested.<node>.<ns>  (reason drain)
    heartbeat label (leader only, KV schedule) ──▶ ckpt.requested.<node>.<ns>  (leave running)
    snapshot-when-ready pod first Ready        ──▶ ckpt.requested.<node>.<ns>  (a template, once)
    bare node-restore pod gone from such node ──▶ the pod is created again (the
                                                  scheduler places it elsewhere)
    ckpt.done / restore.done of a pod          ──▶ a Kubernetes Event on the pod

Restores as a container starts are the node agent's (services/agent/starts):
it sees the container's smr-init waiting, which the cluster's view cannot.

Exactly once in effect: a node going away opens a drain *episode* (its id is
created once, by compare-and-set in KV, and shared by every replica); every
request_id is derived from the episode or the pod's uid, so a repeated event,
a re-list after 410, a restarted watcher or a second replica produce only
duplicates, and JetStream drops those (``Nats-Msg-Id``).
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import socket
import time
import uuid
from collections import Counter, OrderedDict
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.checkpointer.admission import agent_windows
from services.policy import PodPolicy, policy_for
from services.suspension import owner_job, suspension_of
from services.triggers import (
    FINAL_DISRUPTIONS,
    disruption,
    node_reasons,
    pod_reasons,
    shut_down_by_kubelet,
)
from services.watcher.drains import Drains
from services.watcher.durables import NodeConsumers
from services.watcher.events import EventRecorder
from services.watcher.heartbeats import HeartbeatSchedule
from services.watcher.kube import Informer
from services.watcher.leader import Leadership
from services.watcher.limits import MEMO_SIZE, READY_SETTLE_S, REQUEST_TTL_S, STOP_WAIT_S
from services.watcher.lineages import SharedLineages
from services.watcher.recreation import Recreation, deadline_of
from services.watcher.templates import is_ready, ready_since, takes_template, template_requests
from services.watcher.webhook_probe import WebhookProbe
from smr.bus import KV_BEATS, KV_HEALTH, QUERY_LATEST, Bus, consume_events
from smr.config import Settings
from smr.contract.errors import TemporaryError
from smr.contract.messages import CkptRequested, Message, StorageQuery

log = logging.getLogger("smr.watcher")


class Watcher(Drains, Recreation):
    def __init__(self, bus: Bus, api: client.ApiClient, settings: Settings, *,
                 identity: str | None = None, durable_prefix: str = "watcher") -> None:
        self.bus = bus
        self.durable_prefix = durable_prefix
        self.api = api
        self.s = settings
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.core = client.CoreV1Api(api)
        self.nodes = Informer("nodes", self.core.list_node, self._on_node)
        self.consumers = NodeConsumers(bus, lambda: list(self.nodes.cache),
                                       agent_windows(settings))
        self.pods = Informer("pods", self.core.list_pod_for_all_namespaces, self._on_pod)
        self.schedule = HeartbeatSchedule(bus.kv(KV_BEATS), self._publish_all,
                                          keys=lambda: bus.kv_keys(KV_BEATS))
        self.leadership = Leadership(
            api, namespace=settings.lease_namespace, name=settings.lease_name,
            identity=self.identity, lease_s=settings.lease_duration,
            renew_s=settings.lease_renew_deadline, retry_s=settings.lease_retry,
            lead=self._lead)
        self.events = EventRecorder(api)
        self.lineages = SharedLineages(api, self.events)
        # In the watcher's own namespace, which only the webhook's probe entry selects.
        self.webhook_probe = WebhookProbe(self.core, bus.kv(KV_HEALTH), settings,
                                          namespace=settings.lease_namespace,
                                          identity=self.identity)
        self.stats: Counter[str] = Counter()
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._sem = asyncio.Semaphore(settings.publish_concurrency)
        self._episodes: dict[str, str] = {}  # node → open episode id
        self._clean: set[str] = set()  # nodes known to have no open episode
        self._gone: set[str] = set()  # nodes deleted while this process watched
        self._published: OrderedDict[str, None] = OrderedDict()  # request ids sent
        self._sending: dict[str, asyncio.Task[None]] = {}  # request id → its publish in flight
        self._pod_requests: dict[str, list[str]] = {}  # pod uid → its drain checkpoints
        self._reported: set[str] = set()  # policy problems already posted
        self._replacing: set[str] = set()  # Failed pods (uids) being deleted to recreate them
        self._suspended: set[str] = set()  # pods (uids) deleted by their suspended Job
        self._templated: dict[str, set[str]] = {}  # pod uid → template requests looked at
        self._template_failed: set[str] = set()  # pod uids whose template request failed
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self) -> None:
        durable_prefix = self.durable_prefix
        loops = [self.pods.run(), self.nodes.run(), self.leadership.run(),
                 consume_events(self.bus, f"{durable_prefix}-ckpt-done", "ckpt.done",
                                self.events.outcome, service="watcher", stop=self._stop),
                 consume_events(self.bus, f"{durable_prefix}-restore-done", "restore.done",
                                self.events.outcome, service="watcher", stop=self._stop),
                 self.consumers.run(self._stop), self.webhook_probe.run(self._stop)]
        names = ["pod informer", "node informer", "leader election", "ckpt.done consumer",
                 "restore.done consumer", "nodes' request consumers", "webhook probe"]
        tasks = [asyncio.create_task(c) for c in loops]
        try:
            await self.pods.synced.wait()
            await self.nodes.synced.wait()
            self.ready.set()
            log.info("watcher %s: %d nodes, %d pods", self.identity, len(self.nodes.cache),
                     len(self.pods.cache))
            stopped = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for name, t in zip(names, tasks, strict=True):
                if t not in done or self._stop.is_set():
                    continue
                # A loop ends only on a stop: any other end (an error, a
                # cancel a library handed it, a return) ends the watcher,
                # named, for its Deployment to start it again.
                if not t.cancelled() and (e := t.exception()) is not None:
                    raise e
                raise RuntimeError(f"watcher {self.identity}: its {name} ended "
                                   f"{'cancelled' if t.cancelled() else 'on its own'} "
                                   "while the watcher was not stopping")
            stopped.cancel()
        finally:
            pending = [*tasks, *self._tasks]
            for t in pending:
                t.cancel()
            # Bounded: a task that ignores its cancellation must not hang the shutdown.
            _, stuck = await asyncio.wait(pending, timeout=STOP_WAIT_S)
            for t in stuck:
                where = io.StringIO()
                t.print_stack(file=where)
                log.error("watcher: a task did not stop within %.0fs:\n%s", STOP_WAIT_S,
                          where.getvalue())
            await self.leadership.release()

    def stop(self) -> None:
        self._stop.set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("watcher task failed", exc_info=task.exception())

    async def _publish_all(self, msgs: list[Message]) -> None:
        """Publish what this process has not yet sent, up to
        SMR_PUBLISH_CONCURRENCY at once. Two handlers may derive the same
        request at once (a node's cordon and a pod of it arriving in one
        resumed watch): the second waits for the first's publish instead of
        sending it again, and sees its error if it fails."""
        async def send(m: Message) -> None:
            async with self._sem:
                ack = await self.bus.publish(m)
            self.stats["duplicates" if ack.duplicate else "published"] += 1
            self._published[m.request_id] = None  # type: ignore[attr-defined]
            while len(self._published) > MEMO_SIZE:
                self._published.popitem(last=False)

        def sending(m: Message) -> asyncio.Task[None]:
            rid = m.request_id  # type: ignore[attr-defined]
            if (task := self._sending.get(rid)) is None:
                task = self._sending[rid] = asyncio.create_task(send(m))
                self._tasks.add(task)  # a stop cancels it
                task.add_done_callback(lambda t: self._sent(rid, t))
            return task

        todo = [m for m in msgs if m.request_id not in self._published]  # type: ignore[attr-defined]
        if todo:
            # Shielded: one waiter cancelled must not cancel the others' publish.
            await asyncio.gather(*(asyncio.shield(sending(m)) for m in todo))

    def _sent(self, rid: str, task: asyncio.Task[None]) -> None:
        self._sending.pop(rid, None)
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # its waiters report it; none may be left to

    def _policy(self, pod: dict[str, Any]) -> PodPolicy:
        policy = policy_for(pod, self.s)
        meta = pod["metadata"]
        for problem in policy.problems:
            memo = f"{meta.get('uid')}:{problem}"
            if memo not in self._reported:
                self._reported.add(memo)
                log.warning("pod %s/%s: %s", meta.get("namespace"), meta.get("name"), problem)
                self._spawn(self._post(meta, "InvalidSmrPolicy", problem, memo, warning=True))
        return policy

    async def _post(self, meta: dict[str, Any], reason: str, message: str, key: str,
                    warning: bool = False) -> None:
        try:
            await self.events.pod_event(meta["namespace"], meta["name"], reason=reason,
                                        message=message, key=key, warning=warning,
                                        uid=meta.get("uid"))
        except ApiException as e:
            log.warning("cannot post Event %s on pod %s/%s: %s", reason, meta["namespace"],
                        meta["name"], e.reason)

    async def _on_pod(self, kind: str, pod: dict[str, Any], old: dict[str, Any] | None
                      ) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        uid, node = meta.get("uid", ""), spec.get("nodeName")
        policy = self._policy(pod)
        finished = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if kind == "DELETED" or finished:
            if self.leadership.leading.is_set():
                await self.schedule.remove(uid)
            if policy.snapshot_when_ready:
                await self._template_turn_ended(pod, policy)
            if kind == "DELETED":
                self._recreate_later(pod, policy)
                self._pod_requests.pop(uid, None)
                self._suspended.discard(uid)
                self.lineages.forget(uid)
                self._templated.pop(uid, None)
                self._template_failed.discard(uid)
            elif shut_down_by_kubelet(pod) and uid not in self._replacing:
                self._replacing.add(uid)
                self._spawn(self._replace_failed(pod, policy))
            return
        if self.leadership.leading.is_set():
            await self._keep_beat(pod, policy)
            self._check_lineage(pod, policy)
        episode = self._episodes.get(node) if node and policy.opted_in else None
        if episode is not None:
            # On a node going away: the node's reasons, and a drain if it terminates.
            n = self.nodes.cache.get(node)  # type: ignore[arg-type]
            reasons = list(node_reasons(n, self.s.preemption_taints)) if n else ["node-deleted"]
            await self._publish_requests([r for reason in pod_reasons(pod, reasons)
                                          for r in self._drain_requests(pod, episode, reason)])
        elif policy.opted_in and node and meta.get("deletionTimestamp") \
                and disruption(pod) in FINAL_DISRUPTIONS:
            # Evicted or preempted on a node that stays (the descheduler, the
            # scheduler): its preStop hook waits for this final checkpoint.
            await self._publish_requests([r for reason in pod_reasons(pod, [])
                                          for r in self._drain_requests(pod, "", reason)])
        elif policy.opted_in and node and meta.get("deletionTimestamp") \
                and disruption(pod) is None and owner_job(pod) and uid not in self._suspended:
            await self._on_suspension(pod)
        if policy.snapshot_when_ready:
            if is_ready(pod):
                await self._take_template(pod, policy)
            elif old is not None and is_ready(old):
                await self._template_turn_ended(pod, policy)

    async def _on_suspension(self, pod: dict[str, Any]) -> None:
        """A Job's pod deleted with no disruption: if its Job is suspended (a
        queue preempting it), the final checkpoint its preStop hook waits
        for, and an Event saying who suspended it. A Job that cannot be read
        raises: the informer hands the pod in again."""
        found = await suspension_of(self.api, pod)
        if found is None:
            return
        meta = pod["metadata"]
        self._suspended.add(meta["uid"])
        log.info("pod %s/%s: Job %s is suspended (%s); taking its final checkpoint",
                 meta["namespace"], meta["name"], found.job, found.detail)
        self._spawn(self._post(meta, found.event_reason, f"final checkpoint: {found.detail}",
                               f"{meta['uid']}:{found.event_reason}"))
        await self._publish_requests([r for reason in pod_reasons(pod, [], suspended=True)
                                      for r in self._drain_requests(pod, "", reason)])

    async def _take_template(self, pod: dict[str, Any], policy: PodPolicy) -> None:
        """A warm pod's template, once (services/watcher/templates). Raising
        (storage unreachable) makes the informer call this again."""
        # Replicas Ready in the same second (the kubelet's resolution) are
        # ordered once every one of them is seen Ready, not as each comes.
        wait = ready_since(pod) + READY_SETTLE_S - time.time()
        if 0 < wait <= READY_SETTLE_S:
            await asyncio.sleep(wait)
        if not takes_template(pod, list(self.pods.cache.values()),
                              lambda p: self._policy(p).snapshot_when_ready,
                              now=time.time(), turn_s=REQUEST_TTL_S,
                              failed=self._template_failed):
            return  # a replica Ready before it takes the template
        for req in template_requests(pod, policy, deadline_of(pod)):
            seen = self._templated.setdefault(req.target.pod_uid or "", set())
            if req.request_id in self._published or req.request_id in seen:
                continue
            ns = req.target.namespace
            reply = await self.bus.query(QUERY_LATEST, StorageQuery(
                checkpoint_id=req.checkpoint_id, namespace=ns), timeout=10)
            if reply.error:
                raise TemporaryError(f"cannot ask storage whether template {req.checkpoint_id} "
                                     f"exists: {reply.error.get('message', reply.error)}",
                                     code="storage-query-failed")
            if reply.generations:
                seen.add(req.request_id)
                continue  # taken before (by another pod, or before a restart)
            log.info("pod %s/%s is Ready: taking template %s of container %s", ns,
                     req.target.pod, req.checkpoint_id, req.target.container)
            await self._publish_all([req])
            # Looked at once published: a publish that raised is tried again
            # when the informer calls this again.
            seen.add(req.request_id)
            self._spawn(self._follow_template(pod, policy, req))

    async def _follow_template(self, pod: dict[str, Any], policy: PodPolicy,
                               req: CkptRequested) -> None:
        """The template request of the replica taking it failed, or has no
        result within its lifetime (its node's agent down): the next Ready
        replica takes it. Every watcher replica follows it and sees the
        same result (a restarted one too: the step's result stays)."""
        try:
            done = await self.bus.wait_result(req.request_id, "ckpt.requested",
                                              timeout=REQUEST_TTL_S + 60)
            if done.status == "succeeded":
                return
            why = (done.error or {}).get("message", done.status)
        except TimeoutError:
            why = "no result within its lifetime"
        meta = pod["metadata"]
        self._template_failed.add(meta.get("uid", ""))
        log.warning("pod %s/%s: template %s not taken (%s); the next Ready replica takes it",
                    meta.get("namespace"), meta.get("name"), req.checkpoint_id, why)
        await self._template_turn_ended(pod, policy, any_age=True)

    async def _template_turn_ended(self, pod: dict[str, Any], policy: PodPolicy, *,
                                   any_age: bool = False) -> None:
        """``pod`` went or is no longer Ready: should it have been the one
        taking its template, the next Ready replica takes it now (one left
        alone may see no change of its own for ever); the storage check
        skips it where the template was stored meanwhile. Only replicas
        Ready within a template's turn: one Ready for longer had its turn (a
        template deleted since is for a replica restarted to take); any
        (``any_age``) when the template was never taken (its request failed)."""
        meta = pod["metadata"]
        for other in list(self.pods.cache.values()):
            m = other["metadata"]
            if m.get("uid") == meta.get("uid") or m.get("namespace") != meta.get("namespace") \
                    or not is_ready(other) or (
                        not any_age and ready_since(other) < time.time() - REQUEST_TTL_S):
                continue
            theirs = self._policy(other)
            if theirs.snapshot_when_ready != policy.snapshot_when_ready:
                continue
            try:
                await self._take_template(other, theirs)
            except TemporaryError as e:
                # Its own next change (or the informer's retry of it) asks again.
                log.warning("pod %s/%s: template %s not reconsidered: %s", m.get("namespace"),
                            m.get("name"), policy.snapshot_when_ready, e.message)

    async def _publish_requests(self, reqs: list[CkptRequested]) -> None:
        """Final requests first: the agent takes a node's requests in order."""
        await self._publish_all([r for r in reqs if not r.leave_running])
        await self._publish_all([r for r in reqs if r.leave_running])

    async def _keep_beat(self, pod: dict[str, Any], policy: PodPolicy) -> None:
        meta, node = pod["metadata"], (pod.get("spec") or {}).get("nodeName")
        if policy.heartbeat_s and node:
            await self.schedule.upsert(
                meta["uid"], meta["namespace"], meta["name"], node, policy.heartbeat_s,
                [[c.name, c.checkpoint_id] for c in policy.containers])
        elif meta.get("uid") in self.schedule.entries:
            await self.schedule.remove(meta["uid"])

    def _check_lineage(self, pod: dict[str, Any], policy: PodPolicy) -> None:
        """The leader warns on a Job whose pods share one lineage (services/watcher/lineages)."""
        if self.lineages.wants(pod, policy):
            self._spawn(self.lineages.check(pod, policy))

    async def _lead(self) -> None:
        """Run the heartbeat schedule while this replica leads."""
        await self.pods.synced.wait()
        await self.schedule.load()
        live = {p["metadata"]["uid"] for p in self.pods.cache.values()}
        for uid in [u for u in self.schedule.entries if u not in live]:
            await self.schedule.remove(uid)
        for pod in list(self.pods.cache.values()):
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                await self._keep_beat(pod, policy := self._policy(pod))
                self._check_lineage(pod, policy)
        log.info("heartbeat schedule: %d pods", len(self.schedule.entries))
        await self.schedule.run()
