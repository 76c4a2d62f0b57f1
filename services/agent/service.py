"""The node agent: one per Kubernetes node (a privileged DaemonSet pod with
the host's PID namespace). It checkpoints and restores the containers of the
pods on its node:

    ckpt.requested.<node>.<ns>    (pod target) ──▶ PodCheckpointStep
    restore.requested.<node>.<ns> (pod target) ──▶ PodRestoreStep
    a container's smr-init waiting              ──▶ StartRestores (restore or fresh)
    a preStop hook no final checkpoint answers  ──▶ PreStopWaits (released)
    while it runs                               ──▶ its mark of life (alive.py)
    SMR_TEMPLATE_PREPULL's templates in storage ──▶ Prepull (into the template cache)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from kubernetes_asyncio import client

from services.agent import alive, nodelabel
from services.agent.prepull import Prepull
from services.agent.prestop import PreStopWaits
from services.agent.starts import StartRestores
from services.checkpointer.admission import LOOK_AHEAD, CheckpointAdmission
from services.checkpointer.pod import PodCheckpointStep
from services.containers.incontainer import CriuBundle
from services.containers.pods import Fresh, Pods
from services.restorer.pod import PodRestoreStep
from services.storage.cache import ObjectCache
from services.storage.store import CheckpointStore
from smr.aio import ended_why, until_stopped
from smr.bus import KV_LOCKS, KV_STEPS, KV_TIMINGS, Bus, StepLocks, Worker
from smr.config import Settings
from smr.contract.errors import SmrError
from smr.gpu import cuda_checkpoint
from smr.jobs import JobLock
from smr.process.criu import Criu

log = logging.getLogger("smr.agent")

READY_NAG_S = 30.0  # how often an agent not ready yet says what it waits for


class NodeAgent:
    def __init__(self, bus: Bus, api: client.ApiClient, store: CheckpointStore,
                 settings: Settings) -> None:
        s = self.s = settings
        self.pods = Pods(api, s.node)
        self.cache = ObjectCache(s.work_path / "template-cache", s.template_cache_bytes) \
            if s.template_cache_bytes else None
        if self.cache is not None:
            store = store.with_cache(self.cache)
        self.prepull = Prepull(store, s.template_prepull if self.cache is not None else ())
        self.criu = Criu(s.criu_binary(), s.criu_timeout, preload=s.criu_preload(),
                         kept_logs=s.work_path / "criu-logs")
        self.bundle = CriuBundle(s.criu_root(), s.criu_preload(), s.criu_root_switch(),
                                 plugins=s.work_path / ".criu-plugins",
                                 kept_logs=s.work_path / "criu-logs")
        common = dict(
            bundle=self.bundle,
            criu=self.criu,
            store=store, pods=self.pods,
            # A pod's steps all run on its node: a holder its node's step
            # locks call live keeps the container's lock, whatever its beats.
            lock=JobLock(bus.kv(KV_LOCKS), bus.kv(KV_STEPS), wait_s=s.lock_wait,
                         stale_after=bus.config.stale_after,
                         live=StepLocks(s.step_lock_path).live),
            node=s.node, criu_timeout=s.criu_timeout, commit_deadline=s.commit_deadline,
            init_binary=s.init_binary(), label_prefix=s.label_prefix,
            work_dir=s.work_path / "pods",
            cuda=cuda_checkpoint.for_settings(s.gpu, s.cuda_lock_timeout,
                                              hold_dir=s.hold_path, allow=s.gpu_allow))
        checkpoints = PodCheckpointStep(**common, timings=bus.kv(KV_TIMINGS),
                                        node_dir=s.step_lock_path,
                                        capture_bytes=s.capture_bytes,
                                        eviction=s.kubelet_eviction_hard)
        self.workers = [
            Worker(bus, Fresh(checkpoints), s.node, service="agent-checkpointer",
                   locks=StepLocks(s.step_lock_path), concurrency=s.checkpoints_per_node,
                   ahead=LOOK_AHEAD,
                   admission=CheckpointAdmission(s.work_path / "pods", checkpoints.estimate,
                                                 s.checkpoint_scratch,
                                                 s.kubelet_eviction_hard,
                                                 rides=checkpoints.rides)),
            Worker(bus, Fresh(PodRestoreStep(**common)), s.node, service="agent-restorer",
                   locks=StepLocks(s.step_lock_path), concurrency=s.restores_per_node),
        ]
        self.starts = StartRestores(bus, self.pods, s, store)
        self.prestop = PreStopWaits(self.pods, s.node, s.preemption_taints)
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()
        for w in self.workers:
            w.stop()

    async def run(self) -> None:
        if problem := await self.criu.problem():
            log.error("%s", problem)
        await nodelabel.install_and_label(self.s, self.pods.core)  # then the node's labels
        started = time.monotonic()
        tasks = [asyncio.create_task(w.run()) for w in self.workers]
        tasks.append(asyncio.create_task(self.starts.run(self._stop)))
        tasks.append(asyncio.create_task(alive.keep_alive(self.s.agent_mark_path, self._stop)))
        tasks.append(asyncio.create_task(self.prestop.run(self._stop)))
        tasks.append(asyncio.create_task(self.prepull.run(self._stop)))
        idle = asyncio.gather(*(w.idle.wait() for w in self.workers))
        try:
            # Not ready until its workers serve: they may wait for NATS, or for
            # their request consumers, which the watcher makes for each Node (a
            # node's user may make none). It waits up, saying so, rather than
            # exit into a crash loop whose back-off outlasts the watcher's start.
            while not (done := (await asyncio.wait({idle, *tasks}, timeout=READY_NAG_S,
                                                   return_when=asyncio.FIRST_COMPLETED))[0]):
                log.warning("agent not ready after %.0fs: its workers wait for NATS or for "
                            "their request consumers on SMR_REQUESTS (the watcher makes them "
                            "for each Node: is it running?)", time.monotonic() - started)
            if idle in done:
                self.ready.set()
            if ended := await until_stopped(self._stop, tasks):
                # Exit, so that the DaemonSet restarts the agent, rather than
                # stay up without serving its node.
                raise SmrError(f"a worker of the agent ended on its own ({ended_why(ended)})",
                               code="worker-ended", hint="the agent restarts; see its log")
        finally:
            idle.cancel()
            self.stop()
            # wait_for cancels a task still running at 30 s and returns only
            # once it has ended: no task can hand CRIU these descriptors after.
            for t in tasks:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(t, 30)
            self.bundle.close()
