"""Local jobs: launching them in their own PID namespace, and their registry.

A job runs in a new PID namespace (made by ``smr-init --local-ns``) whose init,
smr-init in its ``--local`` mode, leads its own session and starts the
command: that is what CRIU needs to dump the tree and to restore it beside a
still-running original (inside the namespace the PIDs are the same, outside
they never collide). The init stays root when the command drops to another
user (PostgreSQL, any daemon): CRIU has the root of the tree mount a /proc of
its PID namespace, which only a privileged process can. Its own IPC namespace
too: CRIU saves System V shared memory, semaphores and message queues only
with the namespace that holds them (PostgreSQL keeps a System V segment). No
mount namespace: CRIU would then need the whole mount table described.

The registry is the JetStream KV bucket ``smr-jobs`` (job id → record), written
with compare-and-set so two writers never lose each other's update. Each
record is signed (HMAC-SHA256) with a key only root can read: a step acts on a
record only if smr wrote it, so whoever reaches the bus cannot name a process
smr never started and have root freeze, dump or kill it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from smr import config
from smr.contract.errors import PermanentError, SmrError, TemporaryError
from smr.gpu.gpugate import GPU_JOB_DEFAULTS
from smr.process import procfs
from smr.process.tree import process_tree

log = logging.getLogger("smr.jobs")


@dataclass
class Job:
    id: str
    cmd: list[str]
    cwd: str
    log: str
    node: str
    pid: int = 0
    start_ticks: int = 0  # /proc/<pid>/stat starttime: tells a reused PID apart
    state: str = "running"  # running, checkpointed, exited
    checkpoint_id: str = ""
    generation: int | None = None  # latest checkpoint generation
    restored_by: str | None = None  # request_id of the restore that started this pid
    tcp: str = "auto"  # TCP connection policy (smr.process.sockets.POLICIES)
    created_at: float = field(default_factory=time.time)
    sig: str = ""  # HMAC of the rest, by the registry's key (JobRegistry)

    def alive(self) -> bool:
        return self.pid > 0 and proc_start_ticks(self.pid) == self.start_ticks

    def observed_state(self) -> str:
        if self.state == "running" and not self.alive():
            return "exited"
        return self.state

    def checkpointed(self, generation: int, *, leave_running: bool) -> None:
        self.generation = generation
        self.state = "running" if leave_running else "checkpointed"

    def restored(self, pid: int, *, request_id: str, generation: int | None, node: str,
                 start_ticks: int | None = None) -> None:
        """Now the process CRIU restored for ``request_id``; ``start_ticks`` (when it
        started, smr.identity) must be the PID holder's, or it is another process."""
        ticks = proc_start_ticks(pid)
        if ticks is None or (start_ticks is not None and ticks != start_ticks):
            raise PermanentError(f"restored process {pid} is not running", code="restore-died")
        self.pid, self.start_ticks, self.state = pid, ticks, "running"
        self.restored_by, self.generation, self.node = request_id, generation, node


def proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks, or None if there is no such live process."""
    fields = procfs.stat_fields(pid)
    return None if fields is None else int(fields[19])


def own_pid_namespace(pid: int) -> bool:
    """Does ``pid`` run in a PID namespace other than ours (a job started by
    smr-init --local-ns)? Its restore then brings the namespace back, with any host PIDs."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
    except OSError:
        return False


def ns_init_pid(wrapper_pid: int, timeout: float = 5.0) -> int:
    """The host PID of the job: the child that the wrapper (smr-init
    --local-ns, or smr.process.reaper) forked."""
    deadline = time.monotonic() + timeout
    path = Path(f"/proc/{wrapper_pid}/task/{wrapper_pid}/children")
    while time.monotonic() < deadline:
        try:
            kids = path.read_text().split()
        except OSError:
            kids = []
        if kids:
            return int(kids[0])
        time.sleep(0.01)
    raise SmrError(f"the job did not start within {timeout}s", code="job-start-failed")


def gpu_env(base: Mapping[str, str], gpus: str | None = None) -> dict[str, str]:
    """The environment of a GPU job started from ``base``: GPU_JOB_DEFAULTS
    (smr.gpu.gpugate) where ``base`` sets none of them (its own value is the opt-out), and
    ``gpus`` ("N": the first N GPUs; "0,2" or UUIDs: those) as
    CUDA_VISIBLE_DEVICES: a process that sees one GPU enables no peer access
    (XLA enables it between all visible GPUs, and driver 580 cannot restore
    that)."""
    env = {**GPU_JOB_DEFAULTS, **base}
    if gpus:
        if gpus.isdigit():
            if int(gpus) < 1:
                raise SmrError(f"--gpus {gpus}: a job needs one GPU at least",
                               code="invalid-gpus", hint="--gpus 1, or --gpus 0,1")
            gpus = ",".join(str(i) for i in range(int(gpus)))
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def launch(job_id: str, cmd: list[str], *, log: Path, cwd: Path, node: str,
           env: dict[str, str] | None = None, own_pid_namespace: bool = True) -> Job:
    """Start ``cmd`` as a managed job; its output is appended to ``log``.

    ``own_pid_namespace``: the job is the init of a new PID namespace, so its
    restore never collides with live PIDs. GPU jobs go without: the CUDA
    driver fails to initialise in a PID namespace that keeps the host's /proc
    (cudaGetDeviceCount: error 304, measured on the H100 machine), and a
    private /proc makes CRIU's dump fail. Their restore needs the dumped PIDs
    free, which they are once the checkpointed original is reaped: they run
    under ``smr.process.reaper``, a child subreaper that reaps the job and every
    orphan of its tree (the host's PID 1 may never do it).

    In its own namespace the job's PID is its init's (smr-init ``--local``):
    signals to it are forwarded to the command, and its exit is the
    command's."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if own_pid_namespace:
        init = config.load().init_binary()
        # smr-init makes the namespaces and waits for its PID 1 there: util-linux's
        # `unshare --fork` wrote a line of its own into the log after a killed job.
        prefix = [init, "--local-ns", "--"]
    else:
        prefix = [sys.executable, "-m", "smr.process.reaper", "--"]
    with open(log, "ab") as out, open(os.devnull, "rb") as devnull:
        wrapper = subprocess.Popen(
            [*prefix, *cmd],
            stdin=devnull, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
            env=env, start_new_session=True,
        )
    # Reap it when it ends, wherever this process lives on: a zombie would
    # keep its PID taken, and a restore needs that PID.
    threading.Thread(target=wrapper.wait, daemon=True).start()
    pid = ns_init_pid(wrapper.pid)  # the job: the wrapper's child
    ticks = proc_start_ticks(pid)
    if ticks is None:
        raise SmrError(f"job {job_id} exited at once; see {log}", code="job-start-failed")
    return Job(id=job_id, cmd=cmd, cwd=str(cwd), log=str(log), node=node, pid=pid,
               start_ticks=ticks, checkpoint_id=job_id)


def job_key(path: Path, *, create: bool = False) -> bytes | None:
    """The key that signs job records: ``path``, made (0600, never through a
    link) when ``create``; None where it does not exist and is not made."""
    if create and not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written whole, then linked in: never read part-written; one there is kept.
        fd, part = tempfile.mkstemp(dir=path.parent, prefix=".job.key.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            with contextlib.suppress(FileExistsError):
                os.link(part, path)
        finally:
            os.unlink(part)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SmrError(f"cannot read the job key {path}: {e.strerror}", code="job-key",
                       hint="smr's commands run as root, like CRIU; "
                            "or set SMR_JOB_KEY to the key `smr up` uses") from None
    with os.fdopen(fd, "rb") as f:
        key = f.read()
    if len(key) < 32:
        raise SmrError(f"the job key {path} is {len(key)} bytes, not 32", code="job-key",
                       hint="remove it and start `smr up` again; running jobs must be "
                            "started again with `smr exec`")
    return key


class JobChanged(TemporaryError):
    """A job's record was written by another since it was read."""

    code = "job-conflict"


class JobRegistry:
    """``key``: records are signed when written and checked when read; a registry
    without one (a reader that acts on nothing) checks nothing and writes nothing."""

    def __init__(self, kv: KeyValue, key: bytes | None = None) -> None:
        self.kv = kv
        self.key = key

    def _mac(self, record: dict[str, Any]) -> str:
        assert self.key
        return hmac.new(self.key, orjson.dumps(record, option=orjson.OPT_SORT_KEYS),
                        hashlib.sha256).hexdigest()

    def check_writable(self, job_id: str) -> None:
        """Raise unless records can be signed (every step refuses an unsigned one)."""
        if not self.key:
            raise SmrError(f"cannot write the record of job {job_id!r}: no job key to sign it",
                           code="job-key",
                           hint="`smr up` makes it (DATA_DIR/job.key) as it starts: use its "
                                "SMR_DATA_DIR, or set SMR_JOB_KEY to the key it uses")

    def _sign(self, job: Job) -> bytes:
        self.check_writable(job.id)
        record = asdict(job)
        record.pop("sig")
        record["sig"] = self._mac(record)
        return orjson.dumps(record)

    def _verified(self, job_id: str, raw: bytes) -> Job:
        try:
            job = Job(**orjson.loads(raw))
        except (orjson.JSONDecodeError, TypeError) as e:
            raise PermanentError(f"the record of job {job_id!r} is not a job record ({e})",
                                 code="job-not-verified",
                                 hint="`smr rm` it; smr never wrote it") from None
        if self.key:
            record = asdict(job)
            sig = record.pop("sig")
            if not hmac.compare_digest(sig, self._mac(record)) or job.id != job_id:
                raise PermanentError(
                    f"the record of job {job_id!r} was not written by this smr: refusing to "
                    f"act on process {job.pid}", code="job-not-verified",
                    hint="only a job that `smr exec` started or smr restored can be "
                         "checkpointed; a record from another key (SMR_JOB_KEY) or an "
                         "older smr: start the job again with `smr exec`")
        return job

    async def get(self, job_id: str) -> tuple[Job, int]:
        try:
            e = await self.kv.get(job_id)
        except KeyNotFoundError:
            e = None
        if e is None or not e.value:
            raise PermanentError(
                f"no job named {job_id!r}", code="job-not-found",
                hint="`smr ps` lists the jobs; start one with `smr exec -i ID -- CMD`",
            )
        return self._verified(job_id, e.value), e.revision or 0

    async def find(self, job_id: str) -> Job | None:
        try:
            return (await self.get(job_id))[0]
        except PermanentError:
            return None

    async def create(self, job: Job) -> None:
        try:
            await self.kv.create(job.id, self._sign(job))
        except KeyWrongLastSequenceError:
            raise SmrError(
                f"a job named {job.id!r} already exists", code="job-exists",
                hint="choose another id, or `smr rm` the old one",
            ) from None

    async def put(self, job: Job, revision: int | None = None) -> None:
        """Write ``job``; with ``revision``, only if nobody wrote it since."""
        try:
            if revision is None:
                await self.kv.put(job.id, self._sign(job))
            else:
                await self.kv.update(job.id, self._sign(job), last=revision)
        except KeyWrongLastSequenceError:
            raise JobChanged(f"job {job.id} changed while being updated; retrying") from None

    async def read(self, job_id: str) -> tuple[Job | None, int]:
        """The job's record and its revision, for ``replace``: (None, 0)
        where there is none; (None, revision) where one is there that smr
        did not write (it may be replaced, never acted on)."""
        try:
            e = await self.kv.get(job_id)
        except KeyNotFoundError:  # deleted ones too: ``create`` takes their place
            return None, 0
        if e is None or not e.value:
            return None, 0
        try:
            return self._verified(job_id, e.value), e.revision or 0
        except PermanentError:
            return None, e.revision or 0

    async def replace(self, job: Job, revision: int) -> None:
        """Write ``job`` only if its record is still the one ``read``
        returned with ``revision`` (0: still none); else JobChanged. Two
        writers of one id (`smr exec`, a restore) never overwrite each
        other: the later one learns it lost."""
        if revision:
            await self.put(job, revision)
            return
        try:
            await self.kv.create(job.id, self._sign(job))
        except KeyWrongLastSequenceError:
            raise JobChanged(f"job {job.id} was written meanwhile") from None

    async def delete(self, job_id: str) -> None:
        await self.kv.delete(job_id)

    async def all(self, keys: list[str]) -> list[Job]:
        """The jobs of ``keys`` (``Bus.kv_keys(KV_JOBS)``: listed without a
        consumer, which a node's user may not make), deleted ones left out."""
        jobs = []
        for k in sorted(set(keys)):
            if j := await self.find(k):
                jobs.append(j)
        return jobs


class JobLock:
    """Serialises checkpoint and restore steps on one job (KV bucket smr-locks).

    A lock records the request that holds it. Another request waits while the
    holder's step is alive (its state ``running``, its heartbeat fresh), and
    takes the lock over once that step is over (answered, never started, or
    its worker dead), so a crashed worker cannot leave a job locked for good,
    and a restore asked for during a long checkpoint runs after it instead of
    failing.
    """

    def __init__(self, kv: KeyValue, steps: KeyValue, *, wait_s: float = 3600.0,
                 stale_after: float = 24.0, poll_s: float = 0.5,
                 live: Callable[[str], bool] | None = None) -> None:
        self.kv = kv
        self.steps = steps
        self.wait_s = wait_s
        self.stale_after = stale_after
        self.poll_s = poll_s
        # Whether a live worker of this node runs a request, as the kernel
        # knows it (smr.bus.liveness): a holder whose heartbeats lag (its
        # event loop stalled, NATS away for it) is alive all the same.
        self.live = live

    async def acquire(self, job_id: str, request_id: str,
                      waiting: Callable[[str], None] | None = None,
                      check: Callable[[], None] | None = None) -> None:
        """Take the lock, waiting up to ``wait_s`` while another live step
        holds it (``waiting`` is told the holder, once). ``check`` is called
        before each try, and raises to stop waiting: the lock serves its
        waiters in no order, so a step that must give way to another waiter
        asks so itself."""
        deadline = time.monotonic() + self.wait_s
        told = None
        while True:
            if check is not None:
                check()
            holder = await self._try(job_id, request_id)
            if holder is None:
                return
            if time.monotonic() > deadline:
                raise TemporaryError(
                    f"job {job_id} stayed busy with request {holder} for {self.wait_s:.0f}s",
                    code="job-busy", hint="see that step's progress (smr status); this "
                    "request is retried, or raise SMR_LOCK_WAIT")
            if waiting and holder != told:
                waiting(holder)
                told = holder
            await asyncio.sleep(self.poll_s)

    async def _try(self, job_id: str, request_id: str) -> str | None:
        """Take the lock if it is free or its holder's step is over; else the holder."""
        value = orjson.dumps({"request_id": request_id, "at": time.time()})
        try:
            await self.kv.create(job_id, value)
            return None
        except KeyWrongLastSequenceError:
            pass
        try:
            e = await self.kv.get(job_id)
        except KeyNotFoundError:
            return "(released meanwhile)"  # look again at once
        holder = orjson.loads(e.value).get("request_id") if e.value else None
        if holder != request_id and await self._holder_active(holder):
            return str(holder)
        try:
            await self.kv.update(job_id, value, last=e.revision)
            return None
        except KeyWrongLastSequenceError:
            return "(taken meanwhile)"

    async def _holder_active(self, holder: Any) -> bool:
        if not holder:
            return False
        if self.live is not None and self.live(str(holder)):
            return True
        try:
            e = await self.steps.get(holder)
        except KeyNotFoundError:
            return False
        if not e.value:
            return False
        state = orjson.loads(e.value)
        return state.get("state") == "running" and \
            time.time() - float(state.get("heartbeat", 0)) < self.stale_after

    async def release(self, job_id: str, request_id: str) -> None:
        """Release our lock. Never raises for the lock being gone or taken
        over meanwhile, nor for NATS being away: a lock left behind is taken
        over once our step's state says it is over (see ``_holder_active``);
        a failed release must not turn a finished step into an error."""
        try:
            e = await self.kv.get(job_id)
            if e.value and orjson.loads(e.value).get("request_id") == request_id:
                await self.kv.delete(job_id, last=e.revision)
        except KeyNotFoundError:
            return
        except KeyWrongLastSequenceError:
            return  # taken over meanwhile
        except Exception as err:  # nats-py: BadRequestError 10071 for the same race
            log.warning("lock of job %s not released (%s: %s); it is taken over once "
                        "request %s is answered", job_id, type(err).__name__, err, request_id)

    async def sequence(self, job_id: str, request_id: str) -> int:
        """A dump sequence, taken under our lock as a dump starts: the
        revision of a write over our own lock entry, so larger than that of
        any dump whose step held the lock before, and refused (TemporaryError)
        where the lock was taken over since: a holder taken for dead does not
        dump behind its successor's back."""
        try:
            e = await self.kv.get(job_id)
            if e.value and orjson.loads(e.value).get("request_id") == request_id:
                value = orjson.dumps({"request_id": request_id, "at": time.time()})
                return int(await self.kv.update(job_id, value, last=e.revision))
        except (KeyNotFoundError, KeyWrongLastSequenceError):
            pass
        raise TemporaryError(
            f"the lock of {job_id} is no longer held by request {request_id} (another step "
            "took it over, finding this one stale); nothing was dumped", code="lock-lost",
            hint="the request is retried; if this repeats, see why its heartbeats stopped")

    async def epoch(self) -> str:
        """Which lock bucket numbers the sequences now (its stream's creation
        time): sequences of a bucket made again start over, and are never
        compared with the old ones. Asked each time, never kept: a bucket
        made again while this process runs (NATS lost its store, a service
        made the buckets anew) would otherwise lend its small revisions the
        old bucket's epoch, and every later dump would compare as taken
        before the old bucket's (superseded, ``latest`` left behind)."""
        status = await self.kv.status()
        created = status.stream_info.created
        return created.isoformat() if created else ""

    async def holder(self, job_id: str) -> str | None:
        try:
            e = await self.kv.get(job_id)
        except KeyNotFoundError:
            return None
        return orjson.loads(e.value).get("request_id") if e.value else None


def signal_tree(root: int, sig: int) -> None:
    """Send ``sig`` to ``root`` and every descendant (a tree CRIU left stopped)."""
    for pid in process_tree(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


async def wait_exit(pid: int, ticks: int, timeout: float = 10.0) -> bool:
    """Wait until the process is gone (CRIU kills the tree after a dump)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc_start_ticks(pid) != ticks:
            return True
        await asyncio.sleep(0.02)
    return False
