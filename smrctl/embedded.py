"""The embedded mode (`smr up`): nats-server, checkpointer, restorer and
storage for this machine in one process, talking through the same subjects
and storage layout as in a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from pathlib import Path

from services.checkpointer.step import CheckpointStep
from services.restorer.step import RestoreStep
from services.storage.service import StorageService
from services.storage.settings import make_storage_service, make_store
from services.storage.store import CheckpointStore
from smr import tracing
from smr.aio import ended_why, stop_task
from smr.bus import KV_JOBS, KV_LOCKS, KV_STEPS, Bus, BusConfig, StepLocks, Worker
from smr.config import Settings
from smr.contract.errors import SmrError
from smr.gpu import cuda_checkpoint, gpuinfo
from smr.jobs import JobLock, JobRegistry, job_key
from smr.natsserver import NatsServer
from smr.process import procfs, reaper
from smr.process.criu import Criu
from smrctl.reach import BUCKETS
from smrctl.uplock import hold_data_dir, url_file, write_holder

log = logging.getLogger("smr.embedded")


READY_S = 90.0  # NATS restarting as this starts is retried for up to a minute


def windows(s: Settings) -> dict[str, int]:
    """Each request kind's window of this machine's workers (max_ack_pending
    of its durables): made by whoever makes them (`smr node-consumers`)."""
    return {"ckpt.requested": 1, "restore.requested": s.restores_per_node}


def end_leftover_server(last_holder: str, store_dir: Path) -> None:
    """A nats-server an earlier `smr up` of this data directory left running
    (one from before servers died with their parent): ended, so that two never
    share one JetStream directory. Only a process whose command line names
    this store directory is touched: its PID may be anyone's by now."""
    words = last_holder.split()
    if len(words) < 2 or not words[1].isdigit():
        return
    pid = int(words[1])
    argv = procfs.argv(pid)
    if not argv or not argv[0].endswith(b"nats-server") or str(store_dir).encode() not in argv:
        return
    log.warning("ending nats-server %d, left running by an earlier `smr up` of %s",
                pid, store_dir)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)


def write_private(path: Path, text: str) -> None:
    """``text`` into a new file only its owner reads, never through a link."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


class EmbeddedNode:
    """Everything a node runs, started and stopped in order."""

    def __init__(self, settings: Settings, held: tuple[int, str] | None = None) -> None:
        """``held``: the data directory's lock, where `smr up` took it before
        its imports (smrctl.uplock); else it is taken at the start."""
        self.settings = settings
        self._held = held
        self.server: NatsServer | None = None
        self.bus: Bus | None = None
        self.workers: list[Worker] = []
        self.storage: StorageService | None = None
        self.store: CheckpointStore | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.criu_problem: str | None = None
        self._reaping: asyncio.Task[None] | None = None
        self._lock_fd: int | None = None

    @property
    def url(self) -> str:
        if self.server:
            return self.server.url
        return self.settings.nats_url

    async def start(self) -> EmbeddedNode:
        s = self.settings
        # Checkpoint images are copies of memory, and the URL file holds the
        # NATS token: the data dir is its owner's alone.
        s.data_path.mkdir(parents=True, exist_ok=True)
        os.chmod(s.data_path, 0o700)
        self._lock_fd, last = self._held or hold_data_dir(s)
        self._held = None  # the descriptor is closed at the stop
        # Made before the bus is reachable: a command that reaches it (`smr
        # exec` right after `smr up`) signs its job's record with this key.
        key = job_key(s.job_key_path, create=True)
        # The trees CRIU restores come to this process when CRIU exits, not
        # to PID 1 (which may never reap them): see smr.process.reaper.
        if not reaper.become_subreaper():
            log.warning("cannot become a child subreaper: restored jobs are left to PID 1")
        self._reaping = asyncio.create_task(_reap_forever())
        criu = Criu(s.criu_binary(), s.criu_timeout, preload=s.criu_preload(),
                    kept_logs=s.data_path / "logs" / "criu")
        self.criu_problem = await criu.problem()
        if self.criu_problem:
            log.error("%s", self.criu_problem)
        if not s.nats_url:
            # Only smr's own clients: the token is in root-only files.
            store = s.data_path / "nats"
            await asyncio.to_thread(end_leftover_server, last, store)
            self.server = NatsServer(s.nats_server_binary(), store,
                                     token=secrets.token_urlsafe(32), die_with_parent=True)
            # Spawned from the event loop's thread: the server dies with
            # the thread that started it, and this one lives as long as we do.
            self.server.spawn()
            assert self.server.proc is not None
            write_holder(self._lock_fd, f"{os.getpid()} {self.server.proc.pid}\n")
            await asyncio.to_thread(self.server.wait_listening)
            write_private(url_file(s), self.server.client_url)
        tracing.setup("node")
        self.bus = await Bus.connect(self.server.client_url if self.server else s.nats_url,
                                     name=f"smr-node-{s.node}",
                                     config=BusConfig.from_settings(s), buckets=BUCKETS)
        jobs = JobRegistry(self.bus.kv(KV_JOBS), key)
        # A holder this node's step locks call live keeps a job's lock,
        # whatever its heartbeats (a stalled event loop, NATS away for it).
        lock = JobLock(self.bus.kv(KV_LOCKS), self.bus.kv(KV_STEPS), wait_s=s.lock_wait,
                       stale_after=self.bus.config.stale_after,
                       live=StepLocks(s.step_lock_path).live)
        store = self.store = make_store(s)
        self.storage = make_storage_service(self.bus, store, s)
        cuda = cuda_checkpoint.for_settings(s.gpu, s.cuda_lock_timeout,
                                            hold_dir=s.hold_path, allow=s.gpu_allow)
        if cuda:
            log.info("GPU jobs: CUDA checkpoint API available (THP %s)", gpuinfo.thp_mode())
        common = dict(criu=criu, store=store, jobs=jobs, lock=lock,
                      work_dir=s.work_path, node=s.node, cuda=cuda,
                      commit_deadline=s.commit_deadline)
        self.workers = [
            Worker(self.bus, CheckpointStep(**common), s.node, service="checkpointer",
                   locks=StepLocks(s.step_lock_path), concurrency=windows(s)["ckpt.requested"]),
            Worker(self.bus, RestoreStep(**common), s.node, service="restorer",
                   locks=StepLocks(s.step_lock_path),
                   concurrency=windows(s)["restore.requested"]),
        ]
        self.tasks = [asyncio.create_task(w.run()) for w in self.workers]
        self.tasks.append(asyncio.create_task(self.storage.run()))
        ready = asyncio.ensure_future(asyncio.gather(
            *(w.idle.wait() for w in self.workers), self.storage.ready.wait()))
        # Cancelled when the start fails: its end is not news (nor a warning).
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        # A service that fails to start says why, rather than a bare timeout.
        await asyncio.wait([ready, *self.tasks], timeout=READY_S,
                           return_when=asyncio.FIRST_COMPLETED)
        for t in self.tasks:
            if t.done():  # failed, or cancelled from inside (t.exception() would raise)
                ready.cancel()
                raise SmrError(f"a service of node {s.node} failed to start: {ended_why(t)}",
                               code="start-failed", hint="is NATS reachable? see the log above"
                               ) from (None if t.cancelled() else t.exception())
        if not ready.done():
            ready.cancel()
            raise SmrError(f"node {s.node} did not start within {READY_S:.0f}s",
                           code="start-failed", hint="is NATS reachable? see the log above")
        return self

    async def stop(self) -> None:
        if self._reaping:
            self._reaping.cancel()
        for w in self.workers:
            w.stop()
        if self.storage:
            self.storage.stop()
        for t in self.tasks:
            await asyncio.wait([t], timeout=30)  # a graceful end first
            # Past that, cancelled. Whatever its end (an error, or cancelled
            # from inside: awaited, that CancelledError would escape here).
            await stop_task(t)
        if self.store:
            await self.store.close()
        if self.bus:
            await self.bus.close()
        if self.server:
            await asyncio.to_thread(self.server.stop)
            url_file(self.settings).unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the data directory is free for the next `smr up`
            self._lock_fd = None

    async def __aenter__(self) -> EmbeddedNode:
        try:
            return await self.start()
        except BaseException:
            await self.stop()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def _reap_forever(interval: float = 0.5) -> None:
    while True:
        reaper.reap()
        await asyncio.sleep(interval)
