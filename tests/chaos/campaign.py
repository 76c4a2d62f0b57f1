"""The fault campaign: many cycles of checkpoint / leave-running checkpoint /
restore / migrate requests on two nodes while faults hit every part, and an
oracle that checks every outcome after every cycle.

The stack is real: one nats-server (JetStream on disk), moto's S3 server
behind a fault-injecting proxy (tests/chaos/proxy.py), and two `smr up`
processes (node-a, node-b: checkpointer, restorer and storage service each),
each with its scratch directory on a small tmpfs. The workloads are counters
whose every output line carries the digest of their whole memory.

Faults, one per cycle at a random moment of its requests (seeded): SIGKILL of
one node's `smr up` (restarted after a pause), a nats-server restart (its
store kept), S3 answering 5xx, cutting connections (before the answer or
midway through a body), answering slowly or hanging, and a full scratch disk.
And faults below the retries, where botocore's own retries cannot absorb
them: every multipart part failing for longer than the client retries, the
answer of a conditional PUT lost after the write happened, S3 unreachable
from the dump to past the client's retries, and a node SIGKILLed between a
generation's manifest and its ``latest`` pointer. The workloads "hold a
GPU" through a stand-in of the CUDA driver's checkpoint API
(tests/chaos/gpu_standin.py), so every checkpoint suspends and resumes their
GPU state as on a GPU node, and a node is also SIGKILLed while a workload's
GPU is suspended (between the suspend and the dump's end, or a restore and
the driver's restore). Two worker deaths are staged, the moment no timing hits
reliably: a leave-running checkpoint's worker dead between CRIU's dump and
the commit while a later final checkpoint of the job runs and commits
first, then its redelivery recovers the dump (``kill-before-commit``); and a
restore's worker dead after CRIU wrote the pidfile, recovered once the
restored PID belongs to a bystander ``sleep`` (``pid-reuse``).

The oracle, after every cycle:
- every request reached done or failed (with a reason) within its deadline;
- every workload runs exactly once, or is stopped with a restorable latest
  generation (the next cycle restores it);
- no workload runs twice;
- every restore resumed the state it recorded (the first step after it has
  the digest recomputed for that step, and follows a step the job reached);
- every committed generation passes its sha256 check (it is downloaded);
- the job KV agrees with the processes;
- no workload is left stopped, or with its (stand-in) GPU suspended;
- every checkpoint answered ``succeeded`` is at or behind ``latest``, which
  restores; no finished dump is left in a node's work directory once its
  request is answered;
- ``latest`` never names a generation dumped before one it named earlier
  ("rolled back"): by the dump sequence the manifests record where both
  have one, and by the counter state the campaign saw each dump taken
  between (after every request, and every cycle);
- no process smr never started is recorded as a job, or killed;
and at the end, after garbage collection: no multipart upload left, no
object outside a committed generation.

With ``--cluster`` NATS is a 3-server JetStream cluster (tests/nats_cluster.py)
with every stream and bucket replicated 3 times, and NATS faults of their own:
SIGKILL of a stream's leader or of the JetStream meta leader (restarted after
a pause), a server paused (SIGSTOP) for longer than the election timeout, and
``restart-nats`` restarts the whole cluster. NATS runs (one server or a
cluster), as deployed, with the users and permissions deploy/kustomize ships
(tests/nats_auth.py): each node's `smr up` logs in as its own user
(local-node.conf.template), the campaign (playing `smr exec` and the operator)
as smr-admin, and any refusal in a server's log is a violation (a permission
the shipped users lack). ``nats_users=False`` (``--no-nats-users``) runs it
without users.

    .venv/bin/python -m tests.chaos --cycles 200 --seed 7      # the full run
    .venv/bin/python -m tests.chaos --cycles 200 --cluster     # on a NATS cluster
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from services.checkpointer import dumpstamp
from services.restorer.step import IDENTITY as RESTORED_IDENTITY
from services.storage import layout
from services.storage.claims import MISSED_RENEWALS, RENEW_S_MAX
from services.storage.s3 import S3Backend
from services.storage.store import CheckpointStore
from smr import config
from smr.bus import (
    KV_JOBS,
    KV_LOCKS,
    KV_STEPS,
    STREAM_REQUESTS,
    Bus,
    BusConfig,
    message_subject,
    node_token,
    subject,
)
from smr.contract.messages import CkptRequested, RestoreRequested, Target
from smr.identity import ProcessIdentity
from smr.jobs import JobLock, JobRegistry, job_key, launch, own_pid_namespace
from smr.natsserver import NatsServer, free_port
from smr.process.criu import Criu
from smr.process.tree import process_tree
from smrctl import demo_counter as counter
from smrctl.embedded import windows
from tests import moto_s3, nats_auth
from tests.chaos import gpu_standin
from tests.chaos.proxy import FaultProxy
from tests.nats_cluster import NatsCluster

REPO = Path(__file__).resolve().parents[2]

MIB = 16
DEADLINE_S = 120.0  # a request must reach done or failed within this
NODES = ("node-a", "node-b")
FAULT_KINDS = ("none", "kill-node", "restart-nats", "s3-5xx", "s3-cut", "s3-slow", "s3-hang",
               "disk-full", "s3-part-fail", "s3-lost-answer", "s3-down", "kill-after-manifest",
               "kill-gpu-suspended", "kill-before-commit", "pid-reuse")
# On a NATS cluster (--cluster), besides those.
CLUSTER_FAULT_KINDS = ("kill-stream-leader", "kill-meta-leader", "pause-nats")
# Faults that must be on from the start of a cycle's requests to land where
# they are meant to (the dump of a small workload takes a fraction of a second).
AT_ONCE = ("s3-part-fail", "s3-lost-answer", "s3-down", "kill-after-manifest",
           "kill-gpu-suspended")
# Faults that are the cycle's requests themselves (a worker's death staged
# at a moment no timing can hit reliably): ``Campaign.staged``.
STAGED = ("kill-before-commit", "pid-reuse")
OPS = ("checkpoint", "leave-running", "stop-restore", "migrate")
SCRATCH_MB = 192


@dataclass
class Report:
    cycles: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)  # kind/outcome
    failures: Counter[str] = field(default_factory=Counter)  # error codes
    restores_checked: int = 0
    generations_verified: int = 0
    lost: int = 0
    corrupt: int = 0
    double_running: int = 0
    stuck: int = 0
    orphans: int = 0
    latest_behind: int = 0  # a succeeded checkpoint newer than latest
    dumps_left: int = 0  # a finished dump left on disk after its request was answered
    left_stopped: int = 0  # a workload's process left in SIGSTOP
    gpu_suspended: int = 0  # a running workload whose (stand-in) GPU is not RUNNING
    kv_disagreements: int = 0
    rolled_back: int = 0  # latest named a generation dumped before one it named earlier
    strangers: int = 0  # a process smr never started recorded as a job, or killed by smr
    nats_refused: int = 0  # what a NATS server refused one of smr's users (its log)
    crashes: int = 0  # a node's `smr up` exited without being killed
    s3_injected: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    hol: dict[str, float] = field(default_factory=dict)

    def violated(self) -> int:
        return (self.lost + self.corrupt + self.double_running + self.stuck + self.orphans
                + self.kv_disagreements + self.crashes + self.latest_behind + self.dumps_left
                + self.left_stopped + self.gpu_suspended + self.nats_refused
                + self.rolled_back + self.strangers)

    def table(self) -> str:
        rows = [("cycles", self.cycles), ("seconds", f"{self.seconds:.0f}"),
                ("seconds per cycle", f"{self.seconds / max(self.cycles, 1):.1f}")]
        rows += [(f"faults: {k}", v) for k, v in sorted(self.faults.items())]
        rows += [(f"S3 requests hit: {k}", v) for k, v in sorted(self.s3_injected.items())]
        rows += [(f"requests: {k}", v) for k, v in sorted(self.requests.items())]
        rows += [(f"failed with: {k}", v) for k, v in sorted(self.failures.items())]
        rows += [("restores checked (state)", self.restores_checked),
                 ("generations verified (sha256)", self.generations_verified),
                 ("lost", self.lost), ("corrupt", self.corrupt),
                 ("double-running", self.double_running), ("stuck", self.stuck),
                 ("rolled back", self.rolled_back),
                 ("strangers adopted or killed", self.strangers),
                 ("orphans", self.orphans), ("latest behind a success", self.latest_behind),
                 ("finished dumps left on disk", self.dumps_left),
                 ("workloads left stopped", self.left_stopped),
                 ("GPUs left suspended (stand-in)", self.gpu_suspended),
                 ("KV disagreements", self.kv_disagreements),
                 ("NATS permissions refused", self.nats_refused),
                 ("node crashes", self.crashes)]
        rows += [(f"head-of-line: {k}", f"{v:.2f}") for k, v in self.hol.items()]
        width = max(len(str(k)) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def start_moto(port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        moto_s3.command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Node:
    """One `smr up` process, killed and started again at will."""

    def __init__(self, name: str, root: Path, env: dict[str, str]) -> None:
        self.name = name
        self.data = root / name
        self.env = {**env, "SMR_NODE_NAME": name, "SMR_DATA_DIR": str(self.data)}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / f"{name}.log"
        self.log_from = 0  # where the running process's output begins in the log

    def mount(self) -> None:
        self.data.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SCRATCH_MB}m", "tmpfs",
                        str(self.data)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.data)], check=False)

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.log_from = out.tell()
            # `smr up`, with the stand-in GPU driver (tests/chaos/gpu_standin.py).
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.chaos.gpu_standin"], env=self.env, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def last_words(self, lines: int = 25) -> str:
        """The end of the running (or ended) process's output: why a crashed
        node exited, in the report itself (CI keeps no campaign directory)."""
        with open(self.log, "rb") as f:
            f.seek(self.log_from)
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()

    def fill(self) -> tuple[Path, int]:
        """Take all of the scratch disk but a sliver; (the filler, bytes left free)."""
        filler = self.data / "filler"
        st = os.statvfs(self.data)
        free = st.f_bavail * st.f_frsize
        # tmpfs refuses an fallocate of exactly what it reports free: step back.
        for spare in (1 << 20, 4 << 20, 16 << 20):
            done = subprocess.run(["fallocate", "-l", str(max(0, free - spare)), str(filler)],
                                  capture_output=True, check=False)
            if done.returncode == 0:
                break
        st = os.statvfs(self.data)
        return filler, st.f_bavail * st.f_frsize


@dataclass
class Workload:
    id: str
    node: str
    cwd: Path
    log: Path

    def lines(self, start: int = 0) -> list[dict[str, str]]:
        with open(self.log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        return [counter.parse_line(ln) for ln in text.splitlines() if ln.startswith("step=")]

    def size(self) -> int:
        return self.log.stat().st_size


def processes_of(w: Workload) -> list[int]:
    """The counter processes running in ``w``'s directory (however they were started)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if os.readlink(p / "cwd") != str(w.cwd):
                continue
            cmd = (p / "cmdline").read_bytes()
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        # The counter itself, not the `unshare` that started it (its arguments name it too).
        if (b"smrctl.demo_counter" in cmd and b"python" in cmd.split(b"\0")[0]
                and state != "Z"):
            found.append(int(p.name))
    return found


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "Tt"
    except OSError:
        return False


class Campaign:
    def __init__(self, root: Path, seed: int, criu: str, cluster: bool = False,
                 nats_users: bool = True) -> None:
        self.root = root
        self.nats_users = nats_users  # the shipped NATS users, as deployed
        self.users: nats_auth.Rendered | None = None
        self.cluster: NatsCluster | None = None
        # The NATS faults first: a short --each-fault run meets them.
        self.faults = (CLUSTER_FAULT_KINDS if cluster else ()) + FAULT_KINDS
        self.replicas = 3 if cluster else 1
        self.gpu_dir = root / "stand-in-gpu"
        self.rng = random.Random(seed)
        self.seed = seed
        self.criu = criu
        self.report = Report()
        self.workloads: list[Workload] = []
        # (checkpoint id, generation) → the counter steps its dump was taken between
        self.states: dict[tuple[str, int], tuple[int, int]] = {}
        self.staged_states: dict[str, tuple[int, int]] = {}  # request id → of a staged dump
        self.named: dict[str, dict[str, Any]] = {}  # checkpoint id → latest's manifest, last seen
        self.bystanders: list[subprocess.Popen[bytes]] = []
        self.strangers_seen: set[int] = set()

    # -- the stack ---------------------------------------------------------------

    async def __aenter__(self) -> Campaign:
        settings = config.load({})
        login = BusConfig()
        if self.nats_users:
            self.users = nats_auth.render(
                self.root / "nats-auth", nats_auth.shipped(nats_auth.kustomize()),
                nodes={n: f"chaos-{n}-{uuid.uuid4().hex[:8]}" for n in NODES})
            login = nats_auth.config("smr-admin", self.users.passwords["smr-admin"])
        if self.replicas > 1:
            self.cluster = NatsCluster(settings.nats_server_binary(), self.root / "nats",
                                       users=self.users)
            await asyncio.to_thread(self.cluster.start)
            self.nats_url = self.cluster.url
        else:
            self.nats = NatsServer(
                settings.nats_server_binary(), self.root / "nats",
                extra_args=["-c", str(self.users.conf)] if self.users else (),
                env=self.users.env if self.users else None).start()
            self.nats_url = self.nats.url
        port = free_port()
        self.moto = start_moto(port)
        for key, value in (("AWS_ACCESS_KEY_ID", "chaos"), ("AWS_SECRET_ACCESS_KEY", "chaos"),
                           ("AWS_DEFAULT_REGION", "us-east-1")):
            os.environ.setdefault(key, value)
        self.proxy = await FaultProxy(f"http://127.0.0.1:{port}", seed=self.seed).start()
        self.bucket = f"chaos-{uuid.uuid4().hex[:8]}"
        direct = S3Backend(self.bucket, prefix="smr", path_style=True,
                           endpoint_url=f"http://127.0.0.1:{port}")
        for _ in range(100):
            try:
                async with direct._client() as c:
                    await c.create_bucket(Bucket=self.bucket)
                break
            except Exception:
                await asyncio.sleep(0.2)
        # The oracle reads S3 directly, past the faults.
        self.store = CheckpointStore(direct)
        # Both nodes sign and check job records with one key, as nodes that
        # share a NATS must; the campaign writes its jobs' records with it.
        key_file = self.root / "job.key"
        env = {**os.environ, "SMR_NATS_URL": self.nats_url, "SMR_STORAGE": "s3",
               "SMR_NATS_REPLICAS": str(self.replicas),
               "SMR_JOB_KEY": str(key_file),
               "SMR_S3_BUCKET": self.bucket, "SMR_S3_PREFIX": "smr",
               "SMR_S3_ENDPOINT": self.proxy.url, "SMR_S3_PATH_STYLE": "true",
               "SMR_CRIU": self.criu, "SMR_ACK_WAIT": "5", "SMR_METRICS_PORT": "0",
               "SMR_GC_INTERVAL": "100000", "PYTHONUNBUFFERED": "1",
               gpu_standin.DIR_ENV: str(self.gpu_dir),
               "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get(
                   "PYTHONPATH"))))}
        # The topology first, made once, not by three processes racing.
        self.bus = await Bus.connect(self.nats_url, name="smr-chaos", config=replace(
            login, ack_wait=5, replicas=self.replicas))
        self.nodes = {n: Node(n, self.root, {**env, **self.login_env(n)}) for n in NODES}
        if self.users:  # the operator's step (`smr node-consumers`): theirs may create none
            for n, node in self.nodes.items():
                await self.bus.make_node_consumers(n, windows(config.load(node.env)))
        for node in self.nodes.values():
            node.mount()
            node.start()
        self.jobs = JobRegistry(self.bus.kv(KV_JOBS), job_key(key_file, create=True))
        await self._wait_nodes()
        return self

    def login_env(self, node: str) -> dict[str, str]:
        """How ``node``'s `smr up` logs in: its own user, which may not create
        the streams (the campaign's smr-admin made them)."""
        if not self.users:
            return {}
        user = f"smr-node-{node_token(node)}"
        return {"SMR_NATS_USER": user, "SMR_NATS_PASSWORD": self.users.passwords[user],
                "SMR_NATS_SETUP": "false"}

    def check_refusals(self) -> None:
        """Each new refusal in the NATS servers' logs is a violation: with the
        shipped users, a permission smr needs and does not have."""
        servers = self.cluster.servers if self.cluster else [self.nats]
        found = []
        for srv in servers:
            with contextlib.suppress(FileNotFoundError):
                found += [f"{srv.store_dir.name}: {line}" for line in
                          srv.log_file.read_text(errors="replace").splitlines()
                          if "Violation" in line]
        for line in found[self.report.nats_refused:]:
            self.problem(f"NATS refused: {line}")
        self.report.nats_refused = max(self.report.nats_refused, len(found))

    async def __aexit__(self, *exc: object) -> None:
        for b in self.bystanders:
            b.kill()
            b.wait()
        for w in self.workloads:
            for pid in processes_of(w):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await self.bus.close()
        for node in self.nodes.values():
            node.stop()
            node.unmount()
        await self.proxy.stop()
        with contextlib.suppress(Exception):
            await self.store.close()
        self.moto.terminate()
        self.moto.wait(10)
        if self.cluster:
            for srv in self.cluster.servers:  # a paused one would not stop
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(srv.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
            self.cluster.stop()
        else:
            self.nats.stop()

    async def _wait_nodes(self) -> None:
        """Until each node's workers consume their subjects."""
        deadline = time.monotonic() + 60
        for n in NODES:
            name = f"ckpt-requested-{n}"
            while True:
                try:
                    await self.bus.js.consumer_info("SMR_REQUESTS", name)
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{n} never started: see {self.nodes[n].log}"
                                           ) from None
                    await asyncio.sleep(0.2)

    # -- requests ------------------------------------------------------------------

    async def request(self, req: CkptRequested | RestoreRequested) -> dict[str, Any] | None:
        """Publish (again, while NATS is away) and wait for done or failed."""
        kind = "checkpoint" if isinstance(req, CkptRequested) else "restore"
        lo = self.last_step(req.checkpoint_id)  # the job's state at the request, at least
        deadline = time.monotonic() + DEADLINE_S
        published = False
        while time.monotonic() < deadline:
            try:
                if not published:
                    await self.bus.publish(req)
                    published = True
                state, _ = await self.bus.step_state(req.request_id)
            except Exception:
                await asyncio.sleep(0.5)  # NATS restarting: the client reconnects
                continue
            if state and state["state"] in ("done", "failed"):
                result = state["result"]
                self.report.requests[f"{kind} {result['status']}"] += 1
                if kind == "checkpoint" and result["status"] == "succeeded":
                    self.succeeded[req.checkpoint_id] = max(
                        self.succeeded.get(req.checkpoint_id, 0), result["generation"])
                if kind == "checkpoint" and result.get("generation"):
                    # The state it holds: dumped after ``lo`` and before the answer
                    # (exactly known for a dump the campaign staged).
                    self.states.setdefault(
                        (req.checkpoint_id, int(result["generation"])),
                        self.staged_states.pop(req.request_id, None)
                        or (lo, self.last_step(req.checkpoint_id)))
                await self.watch_latest(req.checkpoint_id)
                if result["status"] == "failed":
                    code = (result.get("error") or {}).get("code", "")
                    self.report.failures[code or "(no code)"] += 1
                    if not code or not (result.get("error") or {}).get("message"):
                        self.problem(f"{req.request_id} failed without a reason: {result}")
                return result
            await asyncio.sleep(0.2)
        self.report.stuck += 1
        self.problem(f"{kind} {req.request_id} of {req.checkpoint_id} did not finish within "
                     f"{DEADLINE_S:.0f}s; diagnostics in {self.diagnose(req.node)}")
        return None

    def diagnose(self, node_name: str) -> Path:
        """What a stuck node was doing: its tasks' stacks (SIGUSR1 into its log)
        and the CRIU logs of its scratch directory, which the tmpfs would lose."""
        node = self.nodes[node_name]
        if node.proc and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGUSR1)
        out = self.root / f"diag-{self.report.cycles}-{node_name}"
        for log in node.data.glob("work/**/*.log"):
            dst = out / log.relative_to(node.data)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(log, dst)
        return out

    def problem(self, what: str) -> None:
        line = f"cycle {self.report.cycles}: {what}"
        self.report.problems.append(line)
        # Also at once: a long run's table comes only at its end.
        print(f"chaos: problem: {line}", file=sys.stderr, flush=True)

    def ckpt(self, w: Workload, **kw: Any) -> CkptRequested:
        return CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=w.id,
                             target=Target.job(w.id), node=w.node, **kw)

    async def restore(self, w: Workload, node: str, req: RestoreRequested | None = None
                      ) -> dict[str, Any] | None:
        """Restore ``w`` on ``node``; check that it resumed the state it recorded."""
        before = w.size()
        reached = max((int(ln["step"]) for ln in w.lines()), default=0)
        result = await self.request(req or RestoreRequested(
            request_id=uuid.uuid4().hex, checkpoint_id=w.id, target=Target.job(w.id),
            node=node))
        if result and result["status"] == "succeeded":
            w.node = node
            for _ in range(200):
                after = w.lines(before)
                if len(after) >= 2 or counter.resumed_digest(after):
                    break
                await asyncio.sleep(0.1)
            if not after:
                self.problem(f"{w.id} restored (pid {result.get('pid')}) but never printed")
                self.report.corrupt += 1
                return result
            step = int(after[0]["step"])
            # A restored counter digests its memory at its first step
            # (counter.resumed_digest says when it is the second).
            shown = counter.resumed_digest(after) or after[0]
            at = int(shown["step"])
            if shown.get("digest") != counter.expected_digest(MIB, at) or step > reached + 1:
                self.report.corrupt += 1
                self.problem(f"{w.id} resumed at step {step} with digest {shown.get('digest')} "
                             f"at step {at} (expected {counter.expected_digest(MIB, at)}; "
                             f"it had reached {reached})")
            self.report.restores_checked += 1
        return result

    # -- the cycle -------------------------------------------------------------------

    async def start_workloads(self, n: int) -> None:
        for i in range(n):
            wid = f"w{i}-{uuid.uuid4().hex[:4]}"
            cwd = self.root / "jobs" / wid
            cwd.mkdir(parents=True)
            w = Workload(wid, NODES[i % 2], cwd, cwd / "out.log")
            job = launch(wid, [sys.executable, "-m", "smrctl.demo_counter", "--mib", str(MIB),
                               "--interval", "0.05", "--digest-every", "1"],
                         log=w.log, cwd=cwd, node=w.node, env={**os.environ, gpu_standin.ENV: wid})
            await self.jobs.put(job)
            self.workloads.append(w)
        for w in self.workloads:
            for _ in range(300):
                if w.lines():
                    break
                await asyncio.sleep(0.1)

    async def cycle(self, fault: str | None = None) -> None:
        """One cycle; ``fault``: this one (default: a random one, seeded)."""
        self.report.cycles += 1
        w = self.rng.choice(self.workloads)
        op = self.rng.choice(OPS)
        fault = fault or self.rng.choice(self.faults)
        self.report.faults[fault] += 1
        injector = asyncio.create_task(self.inject(fault, w))
        try:
            if fault == "kill-before-commit":
                await self.kill_before_commit(w)
            elif fault == "pid-reuse":
                await self.pid_reuse(w)
            elif op == "leave-running":
                await self.request(self.ckpt(w, leave_running=True))
            elif op == "checkpoint":
                await self.request(self.ckpt(w))
            else:
                done = await self.request(self.ckpt(w, tcp="close"))
                if done and done["status"] == "succeeded":
                    other = next(n for n in NODES if n != w.node)
                    await self.restore(w, other if op == "migrate" else w.node)
        finally:
            await injector
        await self.settle()
        await self.check()

    async def inject(self, fault: str, w: Workload) -> None:
        if fault in STAGED:
            return  # the cycle's requests stage it
        if fault not in AT_ONCE:
            await asyncio.sleep(self.rng.uniform(0.0, 1.2))
        if fault == "kill-after-manifest":
            await self.kill_after_manifest(w)
        elif fault == "kill-gpu-suspended":
            await self.kill_while_gpu_suspended(w)
        elif fault in ("s3-part-fail", "s3-down"):
            # Longer than botocore's retries (5 attempts, backoff up to ~15 s).
            self.proxy.set(fault[3:])
            await asyncio.sleep(self.rng.uniform(8.0, 20.0))
            self.proxy.set(None)
        elif fault == "s3-lost-answer":
            self.proxy.set("lost-answer")
            await asyncio.sleep(self.rng.uniform(2.0, 6.0))
            self.proxy.set(None)
        elif fault == "kill-node":
            node = self.nodes[w.node if self.rng.random() < 0.8 else self.rng.choice(NODES)]
            node.kill()
            await asyncio.sleep(self.rng.uniform(0.2, 2.0))
            node.start()
        elif fault == "restart-nats" and self.cluster:  # the whole cluster
            for srv in self.cluster.servers:
                srv.stop()
            await asyncio.sleep(self.rng.uniform(0.2, 1.5))
            await asyncio.to_thread(self.cluster.start)
        elif fault == "restart-nats":
            self.nats.stop()
            await asyncio.sleep(self.rng.uniform(0.2, 1.5))
            await asyncio.to_thread(self.nats.start)
        elif fault in ("kill-stream-leader", "kill-meta-leader"):
            await self.kill_nats_leader(fault)
        elif fault == "pause-nats":
            assert self.cluster is not None
            srv = self.rng.choice(self.cluster.servers)
            assert srv.proc is not None
            os.kill(srv.proc.pid, signal.SIGSTOP)
            # Longer than the election timeout (a few seconds): its peers
            # elect others, and it comes back to a cluster that went on.
            await asyncio.sleep(self.rng.uniform(4.0, 8.0))
            os.kill(srv.proc.pid, signal.SIGCONT)
        elif fault.startswith("s3-"):
            self.proxy.set(fault[3:], rate=0.5 if fault == "s3-slow" else 0.3)
            await asyncio.sleep(self.rng.uniform(1.0, 4.0))
            self.proxy.set(None)
        elif fault == "disk-full":
            filler, left = self.nodes[w.node].fill()
            if left > 16 << 20:
                # Space freed as it filled (a step cleaning up): not a full disk
                # this time; counted, so the table says how often it bit.
                self.report.faults["disk-full (not filled)"] += 1
            await asyncio.sleep(self.rng.uniform(1.0, 3.0))
            filler.unlink(missing_ok=True)

    async def kill_nats_leader(self, fault: str) -> None:
        """SIGKILL the leader of the requests stream, or the JetStream meta
        leader, while the cycle's steps run; restarted after a pause."""
        assert self.cluster is not None
        name = ""
        if fault == "kill-stream-leader":
            with contextlib.suppress(Exception):
                info = await asyncio.wait_for(self.bus.js.stream_info(STREAM_REQUESTS), 5)
                name = info.cluster.leader if info.cluster else ""
        else:
            name = await asyncio.to_thread(self.cluster.meta_leader)
        if not name:  # none at this moment (an election): nothing to kill
            self.report.faults[f"{fault} (no leader)"] += 1
            return
        srv = self.cluster.server_named(name)
        self.cluster.kill(srv)
        self.report.faults[f"{fault} (fired)"] += 1
        await asyncio.sleep(self.rng.uniform(0.5, 3.0))
        await asyncio.to_thread(self.cluster.restart, srv)

    async def kill_after_manifest(self, w: Workload) -> None:
        """SIGKILL ``w``'s node the moment S3 has stored a manifest of ``w``,
        before the node hears of it (so before it moves ``latest``)."""
        node = self.nodes[w.node]
        fired = asyncio.Event()

        def kill(path: str) -> None:
            if f"/{w.id}/" in path and not fired.is_set():
                node.kill()
                fired.set()

        self.proxy.after_manifest = kill
        try:
            await asyncio.wait_for(fired.wait(), 30)
            self.report.faults["kill-after-manifest (fired)"] += 1
        except TimeoutError:
            pass
        finally:
            self.proxy.after_manifest = None
        await asyncio.sleep(self.rng.uniform(0.2, 2.0))
        if node.proc and node.proc.poll() is not None:
            node.start()

    async def kill_while_gpu_suspended(self, w: Workload) -> None:
        """SIGKILL ``w``'s node while ``w``'s GPU is suspended: between the
        suspend and the dump's end, or a restore and the driver's restore."""
        node = self.nodes[w.node]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if gpu_standin.state_of(self.gpu_dir, w.id) != "RUNNING":
                node.kill()
                self.report.faults["kill-gpu-suspended (fired)"] += 1
                break
            await asyncio.sleep(0.002)
        await asyncio.sleep(self.rng.uniform(0.2, 2.0))
        if node.proc and node.proc.poll() is not None:
            node.start()

    def supervise(self) -> None:
        """Start a node whose `smr up` exited on its own (as Kubernetes or
        systemd would), and count it: a crash is a finding."""
        for node in self.nodes.values():
            if node.proc and node.proc.poll() is not None:
                self.report.crashes += 1
                self.problem(f"{node.name}'s smr up exited with {node.proc.returncode}; see "
                             f"{node.log}; it ended with:\n{node.last_words()}")
                node.start()

    async def settle(self) -> None:
        """After the cycle's requests: every stopped workload comes back (a user
        restores it), so the next cycle starts from every workload running."""
        self.supervise()
        self.report.s3_injected = Counter(self.proxy.injected)
        for w in self.workloads:
            for _ in range(3):
                if processes_of(w):
                    break
                result = await self.restore(w, w.node)
                if result and result["status"] == "succeeded":
                    break
            else:
                if not processes_of(w) and not await self.restorable(w):
                    self.report.lost += 1
                    self.problem(f"{w.id} is not running and has no restorable generation")

    async def restorable(self, w: Workload) -> bool:
        gen = await self.store.latest(layout.LOCAL_NAMESPACE, w.id)
        if gen is None:
            return False
        with tempfile.TemporaryDirectory(dir=self.root) as tmp:
            try:
                await self.store.fetch(gen, Path(tmp) / "img")
            except Exception as e:
                self.problem(f"{w.id} generation {gen.number} does not download: {e}")
                return False
        return True

    async def check(self) -> None:
        for w in self.workloads:
            pids = processes_of(w)
            if any(stopped(p) for p in pids):
                self.report.left_stopped += 1
                self.problem(f"{w.id} is left stopped: pids {pids}")
            gpu = gpu_standin.state_of(self.gpu_dir, w.id)
            if pids and gpu != "RUNNING":
                self.report.gpu_suspended += 1
                self.problem(f"{w.id} runs with its GPU {gpu}: it would hang")
            if len(pids) > 1:
                self.report.double_running += 1
                self.problem(f"{w.id} runs {len(pids)} times: pids {pids}")
            try:
                job = await self.jobs.find(w.id)
            except Exception as e:
                self.problem(f"job KV unreadable: {e}")
                continue
            running = job is not None and job.state == "running" and job.alive()
            if running != bool(pids):
                self.report.kv_disagreements += 1
                self.problem(f"{w.id}: job KV says {job and job.observed_state()} (pid "
                             f"{job and job.pid}), processes {pids}")
        for w in self.workloads:
            await self.watch_latest(w.id)
        for b in self.bystanders:
            if b.poll() is not None and b.pid not in self.strangers_seen:
                self.strangers_seen.add(b.pid)
                self.report.strangers += 1
                self.problem(f"a bystander `sleep` (pid {b.pid}) that took a restored PID was "
                             f"killed (returncode {b.returncode})")
        # What a result called succeeded is what a restore gets (or older than it).
        for wid, gen_no in self.succeeded.items():
            latest = await self.store.latest(layout.LOCAL_NAMESPACE, wid)
            if latest is None or latest.number < gen_no:
                self.report.latest_behind += 1
                self.problem(f"{wid}: a checkpoint answered succeeded with generation {gen_no}, "
                             f"but latest is {latest and latest.number}")
        await self.check_work_dirs()
        # Every generation committed since the last check downloads and verifies.
        for w in self.workloads:
            for gen in await self.store.generations(layout.LOCAL_NAMESPACE, w.id):
                key = (w.id, gen.number)
                if key in self._verified:
                    continue
                with tempfile.TemporaryDirectory(dir=self.root) as tmp:
                    try:
                        await self.store.fetch(gen, Path(tmp) / "img")
                        self.report.generations_verified += 1
                    except Exception as e:
                        self.report.corrupt += 1
                        self.problem(f"{w.id} generation {gen.number}: {e}")
                self._verified.add(key)

    _verified: set[tuple[str, int]] = set()
    succeeded: dict[str, int] = {}  # checkpoint id → newest generation a success named

    def last_step(self, wid: str) -> int:
        w = next((w for w in self.workloads if w.id == wid), None)
        return max((int(ln["step"]) for ln in w.lines()), default=0) if w else 0

    def dumped_before(self, wid: str, a: dict[str, Any], b: dict[str, Any]) -> bool:
        """Was generation ``a``'s dump taken before ``b``'s? By the dump
        sequence both manifests record, where they do (one lock bucket), and
        by the counter state the campaign saw each dump taken between, where
        it knows both: either one saying so is enough. Neither: by number
        (the order they were committed in)."""
        da, db = a.get("dump"), b.get("dump")
        if isinstance(da, dict) and isinstance(db, dict) and \
                da.get("lock_epoch") == db.get("lock_epoch") and \
                isinstance(da.get("seq"), int) and isinstance(db.get("seq"), int) and \
                da["seq"] < db["seq"]:
            return True
        sa = self.states.get((wid, int(a["generation"])))
        sb = self.states.get((wid, int(b["generation"])))
        if sa and sb:
            return sa[1] < sb[0]
        return int(a["generation"]) < int(b["generation"])

    async def watch_latest(self, wid: str) -> None:
        """The "rolled back" oracle: ``latest`` never names a generation
        dumped before one it named earlier."""
        try:
            latest = await self.store.latest(layout.LOCAL_NAMESPACE, wid)
        except Exception:
            return  # looked at again after the next request
        if latest is None:
            return
        prev = self.named.get(wid)
        if prev is not None and int(prev["generation"]) != latest.number and \
                self.dumped_before(wid, latest.manifest, prev):
            self.report.rolled_back += 1
            self.problem(f"{wid}: latest moved back from generation {prev['generation']} "
                         f"(state {self.states.get((wid, int(prev['generation'])))}) to "
                         f"{latest.number} (state {self.states.get((wid, latest.number))}), "
                         "dumped before it")
        self.named[wid] = latest.manifest

    def stale_step(self, req: CkptRequested | RestoreRequested, phase: str) -> bytes:
        """A step state as a worker that died mid-step leaves it: running, its
        heartbeat long stale; the next delivery recovers it."""
        return orjson.dumps({
            "state": "running", "owner": f"{phase}@dead/1/x", "claim": uuid.uuid4().hex,
            "heartbeat": time.time() - 600, "attempt": 1, "subject": message_subject(req),
            "phase": phase, "checkpoint_id": req.checkpoint_id})

    async def kill_before_commit(self, w: Workload) -> None:
        """A leave-running checkpoint A of ``w`` whose worker died after
        CRIU's dump and before its commit; a later final checkpoint B of
        ``w`` runs and is committed before A's redelivery recovers it (on a
        node agent B goes first: it is delivered at once, and finals lead).
        A's dump is made as the node makes it (CRIU, leave running, into
        the node's work directory), its step left as a dead worker leaves it."""
        node = self.nodes[w.node]
        job = await self.jobs.find(w.id)
        if job is None or not job.alive():
            self.report.faults["kill-before-commit (not running)"] += 1
            return
        a = self.ckpt(w, leave_running=True)
        s = config.load(node.env)
        work = node.data / "work"
        # As the node's step begins: its state, the job's lock, and what it
        # records of the dump before CRIU runs (the dump's stamp, by which
        # dumps are ordered: services/checkpointer/dumpstamp).
        await self.bus.kv(KV_STEPS).put(a.request_id, self.stale_step(a, "checkpoint"))
        lock = JobLock(self.bus.kv(KV_LOCKS), self.bus.kv(KV_STEPS), wait_s=30)
        await lock.acquire(w.id, a.request_id)
        # The job's GPU as the node records it before each dump (the stand-in
        # driver's: the same at every checkpoint of this workload).
        prior = await self.store.latest(layout.LOCAL_NAMESPACE, w.id)
        facts: dict[str, Any] = {
            "gpu": prior.manifest.get("gpu") if prior else None, "leave_running": True,
            "process": {"pid": job.pid, "start_ticks": job.start_ticks,
                        "pids": process_tree(job.pid),
                        "own_pid_namespace": own_pid_namespace(job.pid)}}
        facts["dump"] = await dumpstamp.take(lock, w.id, a.request_id)
        work.mkdir(parents=True, exist_ok=True)
        (work / f"{a.request_id}.facts.json").write_bytes(orjson.dumps(facts))
        lo = self.last_step(w.id)
        try:
            await Criu(self.criu, s.criu_timeout, preload=s.criu_preload()).dump(
                job.pid, work / a.request_id / "images", leave_running=True)
        except Exception as e:
            self.report.faults["kill-before-commit (dump failed)"] += 1
            self.problem(f"{w.id}: the staged dump failed: {e}")
            return
        self.staged_states[a.request_id] = (lo, self.last_step(w.id))
        self.report.faults["kill-before-commit (fired)"] += 1
        await self.until_step(w, self.last_step(w.id) + 5)  # the job runs on past A
        await self.request(self.ckpt(w))  # B, final
        await self.request(a)  # A's redelivery: its recovery

    async def until_step(self, w: Workload, step: int) -> None:
        for _ in range(300):  # 30 s at most
            if self.last_step(w.id) >= step:
                return
            await asyncio.sleep(0.1)

    def bystander(self) -> subprocess.Popen[bytes]:
        """A process smr has nothing to do with, ended with the campaign: it
        never ends by itself, so any end before then is a kill."""
        b = subprocess.Popen(["sleep", "infinity"], start_new_session=True)
        self.bystanders.append(b)
        return b

    async def pid_reuse(self, w: Workload) -> None:
        """A restore of ``w`` whose worker died after CRIU wrote its pidfile
        and the restored process's identity; by its recovery that process has
        ended and a bystander (``sleep``) holds its PID. The bystander must
        never be recorded as ``w`` (then dumped and killed by its next
        checkpoint): the restore runs again."""
        done = await self.request(self.ckpt(w, tcp="close"))
        if not (done and done["status"] == "succeeded"):
            self.report.faults["pid-reuse (not stopped)"] += 1
            return
        bystander = self.bystander()
        r = RestoreRequested(request_id=uuid.uuid4().hex, checkpoint_id=w.id,
                             target=Target.job(w.id), node=w.node)
        work = self.nodes[w.node].data / "work" / r.request_id
        work.mkdir(parents=True)
        (work / "restored.pid").write_text(str(bystander.pid))
        ident = ProcessIdentity.of(bystander.pid)
        assert ident is not None
        # The process that held the PID when CRIU returned started earlier.
        ProcessIdentity(ident.pid, ident.start_ticks - 1, ident.boot_id).write(
            work / RESTORED_IDENTITY)
        await self.bus.kv(KV_STEPS).put(r.request_id, self.stale_step(r, "restore"))
        self.report.faults["pid-reuse (fired)"] += 1
        await self.restore(w, w.node, r)
        job = await self.jobs.find(w.id)
        if job is not None and job.pid == bystander.pid:
            self.report.strangers += 1
            self.strangers_seen.add(bystander.pid)
            self.problem(f"{w.id}: the bystander `sleep` (pid {bystander.pid}) that took the "
                         "restored PID was recorded as the job")

    async def check_work_dirs(self) -> None:
        """No finished dump stays on a node once its request is answered: it
        is either stored (and dropped) or given up on (and dropped)."""
        for node in self.nodes.values():
            for work in (node.data / "work").glob("*"):
                if not (work / "images" / "dump.log").is_file():
                    continue
                if "Dumping finished successfully" not in (
                        work / "images" / "dump.log").read_text(errors="replace"):
                    continue
                state, _ = await self.bus.step_state(work.name)
                if state and state["state"] in ("done", "failed"):
                    self.report.dumps_left += 1
                    self.problem(f"{node.name}: the finished dump of {work.name} was left on "
                                 f"disk ({state['state']})")
                    shutil.rmtree(work, ignore_errors=True)  # counted once

    # -- the end -------------------------------------------------------------------

    async def orphans(self) -> None:
        """After GC (nothing in flight): no upload left, no object outside a
        committed generation."""
        # Every writer is over: all are past the renewals their claims name.
        await self.store.gc(grace_s=0, at=time.time() + MISSED_RENEWALS * RENEW_S_MAX + 1)
        backend = self.store.backend
        pending = await backend.pending_uploads("")
        for up in pending:
            self.problem(f"multipart upload left: {up.key}")
        self.report.orphans += len(pending)
        keep: set[str] = set()
        for w in self.workloads:
            if await self.store.latest(layout.LOCAL_NAMESPACE, w.id):
                keep.add(layout.latest_key(layout.LOCAL_NAMESPACE, w.id))
            for gen in await self.store.generations(layout.LOCAL_NAMESPACE, w.id):
                n = gen.number
                keep.add(layout.manifest_key(layout.LOCAL_NAMESPACE, w.id, n))
                keep.add(layout.claim_key(layout.LOCAL_NAMESPACE, w.id, n))
                keep |= {layout.file_key(layout.LOCAL_NAMESPACE, w.id, n, f["path"])
                         for f in gen.manifest["files"]}
        for key in await backend.list(""):
            if key not in keep:
                self.report.orphans += 1
                self.problem(f"unreferenced object after GC: {key}")

    async def head_of_line(self, bad: int = 300) -> None:
        """How long a valid request waits behind ``bad`` malformed ones."""
        w = self.workloads[0]

        async def timed() -> float:
            t = time.monotonic()
            result = await self.request(self.ckpt(w, leave_running=True))
            took = (result or {}).get("durations", {}).get("total", 0.0)
            return time.monotonic() - t - took

        alone = await timed()
        subj = subject("ckpt.requested", w.node, "local")
        for i in range(bad):
            await self.bus.publish_raw(subj, b'{"schema_version": 1, "request_id": "bad-%d"' % i)
        behind = await timed()
        self.report.hol = {"wait alone (s)": alone, f"wait behind {bad} bad (s)": behind,
                           "per bad message (ms)": 1000 * (behind - alone) / bad}


async def run(cycles: int, seed: int, criu: str, workloads: int = 3,
              root: Path | None = None, keep: bool = False, each_fault: bool = False,
              cluster: bool = False, nats_users: bool = True) -> Report:
    """The campaign; ``keep`` leaves its directory (node logs, job logs) in
    place; ``each_fault``: the cycles take every fault kind in turn (the short
    version in `make test` meets each at least once)."""
    root = root or Path(tempfile.mkdtemp(prefix="smr-chaos-"))
    t0 = time.monotonic()
    async with Campaign(root, seed, criu, cluster=cluster, nats_users=nats_users) as c:
        await c.start_workloads(workloads)
        for i in range(cycles):
            await c.cycle(c.faults[i % len(c.faults)] if each_fault else None)
            c.check_refusals()
            if (i + 1) % 20 == 0:  # long work shows progress
                print(f"chaos: {i + 1}/{cycles} cycles, {time.monotonic() - t0:.0f}s, "
                      f"{c.report.violated()} violations", file=sys.stderr, flush=True)
        c.proxy.set(None)
        await c.head_of_line()
        await c.orphans()
        c.check_refusals()
        c.report.seconds = time.monotonic() - t0
        report = c.report
    if keep or report.problems:  # the node logs the problems name
        print(f"campaign directory kept: {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return report
