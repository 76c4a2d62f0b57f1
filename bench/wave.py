"""A reclaim wave: 50 nodes holding 20 opted-in pods each are cordoned within
one second. How long until every ckpt.requested is consumed and every
ckpt.done recorded, on one nats-server and on a 3-server JetStream cluster
(SMR_NATS_REPLICAS=3)? Then the wave again on the cluster with the requests
stream's leader SIGKILLed when half the requests have been consumed
(``cluster-kill``); optionally (``--waves``) that leader SIGSTOPped for
PAUSE_S instead (``cluster-pause``), or the whole cluster stopped and
started again (``cluster-restart``).
Each wave gets a fresh nats-server or cluster.

``--base REV``: the watcher, the storage service and the stand-ins of commit
REV (checked out in a temporary git worktree) and of this tree, wave by wave
in turns, so the two share the machine's drift (the bench's own process is
this tree's).

Real: the watcher (its own process, `python -m services.watcher`, against the
FAKE Kubernetes API server of the tests over HTTP), nats-server(s), the
storage service (its own process, `python -m services.storage`, local
backend), smr's Worker on each node's durable consumer. The bench's process
holds the fake API server and the observers only: the observers read ids
with orjson, not through the schema check (a message costs that ~2 ms of
CPU), so the API server is not starved by the measuring. STAND-INS: the
checkpointers; each node's is a Worker whose step sleeps a fixed delay and
succeeds instead of dumping a pod (tests/test_bus.py's CountingStep with a
delay), so the numbers are smr's bus and watcher, not CRIU.

Latency of a request = from its node's cordon (the Node update) to the moment
its stand-in step starts (the worker has fetched it and claimed its step
state). Peak memory: VmHWM of the watcher's and the nats-servers' processes.

    .venv/bin/python bench/wave.py [--nodes 50] [--pods 20] [--delay 0.05] [--base REV]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from smr import config
from smr.bus import (
    STREAM_EVENTS,
    STREAM_REQUESTS,
    Bus,
    BusConfig,
    Progress,
    StepLocks,
    Worker,
)
from smr.contract.errors import SmrError
from smr.contract.messages import CkptDone, CkptRequested
from smr.natsserver import NatsServer, free_port
from tests.fake_apiserver import FakeApiServer, node, pod
from tests.nats_cluster import NatsCluster

REPO = Path(__file__).resolve().parent.parent
PAUSE_S = 6.0  # a paused server: longer than JetStream's election timeout (a few s)
WAVES = ("single", "cluster", "cluster-kill", "cluster-pause", "cluster-restart")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def vm_hwm_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Wave:
    label: str
    started: dict[str, float] = field(default_factory=dict)  # request → step start
    runs: dict[str, int] = field(default_factory=dict)  # request → times its step ran
    held: dict[str, float] = field(default_factory=dict)  # request → a consumer holds it
    done: dict[str, float] = field(default_factory=dict)  # request → ckpt.done seen
    latency: list[float] = field(default_factory=list)  # cordon → step start
    held_latency: list[float] = field(default_factory=list)  # cordon → a consumer holds it
    to_last_consumed: float = 0.0
    to_last_done: float = 0.0
    watcher_mib: float = 0.0
    nats_mib: list[float] = field(default_factory=list)
    killed: str = ""
    killed_at: float = 0.0

    def pause(self) -> float:
        """The longest time after the kill in which no step started."""
        after = sorted([self.killed_at, *(t for t in self.started.values()
                                           if t >= self.killed_at)])
        return max((b - a for a, b in itertools.pairwise(after)), default=0.0)


class StandInCheckpointer:
    """STAND-IN for a node's checkpointer: waits ``delay`` and succeeds. What
    it finished is its "storage": ``recover`` finds a finished step there, as
    the real checkpointer finds its checkpoint, so a step whose result was
    not recorded (NATS away) is answered, not run again."""

    kind = "ckpt.requested"

    def __init__(self, delay: float, seen: dict[str, Any]) -> None:
        self.delay = delay
        self.seen = seen  # started, runs, node, finished: per request

    async def run(self, req: CkptRequested, progress: Progress) -> CkptDone:
        rid, s = req.request_id, self.seen
        s["started"].setdefault(rid, time.time())
        s["node"][rid] = req.node
        s["runs"][rid] = s["runs"].get(rid, 0) + 1
        await asyncio.sleep(self.delay)
        result = CkptDone.for_request(req, status="succeeded", generation=1)
        s["finished"][rid] = result.to_dict()
        return result

    async def recover(self, req: CkptRequested, state: dict[str, Any]) -> CkptDone | None:
        done = self.seen["finished"].get(req.request_id)
        return CkptDone.from_dict(done) if done else None


async def standins(a: argparse.Namespace) -> None:
    """The stand-in checkpointers of every node, in a process of their own (a
    node's agent is not in the watcher's or the bench's process); on SIGTERM
    what they saw goes to ``--out``."""
    seen: dict[str, Any] = {"started": {}, "node": {}, "runs": {}, "finished": {}}
    bus = await Bus.connect(a.url, name="bench-standins",
                            config=BusConfig(replicas=a.replicas, ack_wait=5.0))
    workers = []
    for n in a.standin_nodes.split(","):
        w = Worker(bus, StandInCheckpointer(a.delay, seen), n, service="standin",
                   locks=StepLocks(Path(a.out + ".steps")), concurrency=a.concurrency)
        workers.append((w, asyncio.create_task(w.run())))
    await asyncio.gather(*(asyncio.wait_for(w.idle.wait(), 120) for w, _ in workers))
    Path(a.out + ".ready").write_text("")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for w, _ in workers:
        w.stop()
    await asyncio.gather(*(t for _, t in workers), return_exceptions=True)
    await bus.close()
    Path(a.out).write_bytes(orjson.dumps(seen))


async def wait_ready(port: int, proc: asyncio.subprocess.Process, timeout: float = 120
                     ) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            raise RuntimeError(f"the watcher exited with {proc.returncode}")
        try:
            await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1))
            return
        except OSError:
            await asyncio.sleep(0.2)
    raise RuntimeError("the watcher did not become ready")


async def child(args: list[str], env: dict[str, str], log: Path, tree: Path
                ) -> asyncio.subprocess.Process:
    """A process running ``tree``'s code (before what PYTHONPATH has: wheels, say)."""
    path = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    with open(log, "wb") as f:
        return await asyncio.create_subprocess_exec(
            *args, env={**os.environ, "PYTHONPATH": path, **env}, cwd=tree, stdout=f,
            stderr=asyncio.subprocess.STDOUT)


async def end(proc: asyncio.subprocess.Process, name: str, log: Path) -> None:
    if proc.returncode is None:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 60)
    if proc.returncode not in (0, -signal.SIGTERM):
        tail = log.read_text(errors="replace")[-3000:]
        print(f"# the {name} exited with {proc.returncode}:\n{tail}", flush=True)


async def one_wave(label: str, url: str, replicas: int, a: argparse.Namespace, work: Path,
                   nats_pids: list[int], tree: Path, kill: Any = None) -> Wave:
    wave = Wave(label)
    total = a.nodes * a.pods
    bus = await Bus.connect(url, name="bench-wave",
                            config=BusConfig(replicas=replicas, ack_wait=5.0))
    kube = await FakeApiServer().start()
    run = uuid.uuid4().hex[:6]
    names = [f"wave-{run}-n{i:02d}" for i in range(a.nodes)]
    for n in names:
        kube.put("nodes", node(n))
        for j in range(a.pods):
            kube.put("pods", pod(f"{n}-p{j:02d}", n, labels={"smr.dev/node-restore": "true"}))
    half = asyncio.Event()
    all_done = asyncio.Event()

    async def got_done(m: Any) -> None:
        rid = orjson.loads(m.data)["request_id"]
        wave.done.setdefault(rid, time.time())
        if len(wave.done) >= total // 2:
            half.set()
        if len(wave.done) >= total:
            all_done.set()

    async def got_request(m: Any) -> None:
        wave.held.setdefault(orjson.loads(m.data)["request_id"], time.time())

    # What a JetStream consumer holds, as bench/watcher.py measures it.
    subs = [await bus.js.subscribe("ckpt.done.*.*", stream=STREAM_EVENTS, ordered_consumer=True,
                                   cb=got_done, deliver_policy="new"),  # type: ignore[arg-type]
            await bus.js.subscribe("ckpt.requested.*.*", stream=STREAM_REQUESTS,
                                   ordered_consumer=True, cb=got_request,
                                   deliver_policy="new")]  # type: ignore[arg-type]
    # The stand-ins in --standin-procs processes, each serving a share of the nodes.
    k = max(1, min(a.standin_procs, a.nodes))
    outs = [work / f"standins-{run}-{i}.json" for i in range(k)]
    agents = [await child(
        [sys.executable, str(tree / "bench" / "wave.py"), "--standin", "--url", url,
         "--replicas", str(replicas), "--standin-nodes", ",".join(names[i::k]),
         "--out", str(outs[i]), "--delay", str(a.delay),
         "--concurrency", str(a.concurrency)], {}, work / f"standins-{run}-{i}.log", tree)
        for i in range(k)]
    storage = await child(
        [sys.executable, "-m", "services.storage"],
        {"SMR_NATS_URL": url, "SMR_NATS_REPLICAS": str(replicas), "SMR_HEALTH_PORT": "0",
         "SMR_METRICS_PORT": "0", "SMR_NODE_NAME": "storage",
         "SMR_DATA_DIR": str(work / f"storage-{run}")}, work / f"storage-{run}.log", tree)
    health = free_port()
    watcher = await child(
        [sys.executable, "-m", "services.watcher"],
        {"SMR_NATS_URL": url, "SMR_KUBE_API": kube.url, "SMR_NATS_REPLICAS": str(replicas),
         "SMR_LEASE_NAME": f"wave-{run}", "SMR_HEALTH_PORT": str(health),
         "SMR_METRICS_PORT": "0", "SMR_NODE_NAME": "watcher",
         "SMR_DATA_DIR": str(work / f"watcher-{run}")}, work / f"watcher-{run}.log", tree)
    try:
        await wait_ready(health, watcher)
        while not all(Path(str(o) + ".ready").exists() for o in outs):
            if any(p.returncode is not None for p in agents):
                raise RuntimeError("stand-ins exited")
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # the watcher's watches open after ready
        cordoned: dict[str, float] = {}
        gap = a.spread / max(1, a.nodes - 1)
        for n in names:  # the wave: every node cordoned within ``spread`` seconds
            obj = kube.get("nodes", n)
            assert obj is not None
            obj["spec"]["unschedulable"] = True
            cordoned[n] = time.time()
            kube.put("nodes", obj)
            await asyncio.sleep(gap)
        if kill is not None:
            await asyncio.wait_for(half.wait(), a.timeout)
            wave.killed_at = time.time()
            wave.killed = await kill(bus)
        try:
            await asyncio.wait_for(all_done.wait(), a.timeout)
        except TimeoutError:
            print(f"# {label}: only {len(wave.done)} of {total} ckpt.done within "
                  f"{a.timeout}s", flush=True)
            await explain_missing(bus, wave, names)
        wave.watcher_mib = vm_hwm_mib(watcher.pid) if watcher.returncode is None else 0.0
        wave.nats_mib = [vm_hwm_mib(p) for p in nats_pids if Path(f"/proc/{p}").exists()]
    finally:
        await end(watcher, "watcher", work / f"watcher-{run}.log")
        await end(storage, "storage service", work / f"storage-{run}.log")
        for i, p in enumerate(agents):
            await end(p, "stand-ins", work / f"standins-{run}-{i}.log")
        for sub in subs:
            await sub.unsubscribe()
        await kube.stop()
        await bus.close()
    seen: dict[str, dict[str, Any]] = {"started": {}, "node": {}, "runs": {}}
    for o in outs:
        if o.exists():
            part = orjson.loads(o.read_bytes())
            for key in seen:
                seen[key].update(part[key])
    wave.started, wave.runs = seen["started"], seen["runs"]
    t0 = min(cordoned.values())
    # A request's latency starts at its node's cordon.
    wave.latency = [t - cordoned[seen["node"][rid]] for rid, t in wave.started.items()]
    node_of = {rid: seen["node"].get(rid) for rid in wave.held}
    wave.held_latency = [t - cordoned[n] for rid, t in wave.held.items()
                         if (n := node_of[rid]) in cordoned]
    wave.to_last_consumed = max(wave.started.values()) - t0 if wave.started else 0
    wave.to_last_done = max(wave.done.values()) - t0 if wave.done else 0
    return wave


async def explain_missing(bus: Bus, wave: Wave, names: list[str]) -> None:
    """Where the requests of the nodes short of ckpt.done are: in the stream
    or not, and what each node's consumer says of them."""
    seen = {rid for rid in wave.held}
    consumers = {c.config.filter_subject: c for c in await bus.js.consumers_info(STREAM_REQUESTS)}
    for n in names:
        subj = f"ckpt.requested.{n}"
        info = await bus.js.stream_info(STREAM_REQUESTS, subjects_filter=subj)
        stored = (info.state.subjects or {}).get(subj, 0)
        c = consumers.get(subj)
        state = (f"delivered {c.delivered.stream_seq}, ack floor {c.ack_floor.stream_seq}, "
                 f"pending {c.num_pending}, ack pending {c.num_ack_pending}, waiting "
                 f"{c.num_waiting}, leader {c.cluster.leader if c.cluster else '-'}"
                 if c else "no consumer")
        print(f"#   {n}: {stored} stored; consumer: {state}", flush=True)
    print(f"#   observed published: {len(seen)}", flush=True)


def row(w: Wave, total: int) -> list[str]:
    lost = total - len(w.done)
    doubled = sum(1 for n in w.runs.values() if n > 1)
    held = w.held_latency or [float("nan")]
    return [f"{pct(held, 50):.2f}", f"{pct(held, 99):.2f}",
            f"{pct(w.latency, 50):.2f}", f"{pct(w.latency, 99):.2f}", f"{max(w.latency):.2f}",
            f"{w.to_last_consumed:.2f}", f"{w.to_last_done:.2f}", f"{w.watcher_mib:.0f}",
            "/".join(f"{m:.0f}" for m in w.nats_mib), f"{len(w.done)}/{total}", str(lost),
            str(doubled)]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.strip()


async def fresh_wave(kind: str, label: str, a: argparse.Namespace, work: Path, tree: Path,
                     s: config.Settings) -> Wave:
    """One wave of ``tree``'s watcher and stand-ins on a fresh server or cluster."""
    store = work / f"nats-{uuid.uuid4().hex[:6]}"
    if kind == "single":
        srv = NatsServer(s.nats_server_binary(), store).start()
        try:
            assert srv.proc is not None
            return await one_wave(label, srv.url, 1, a, work, [srv.proc.pid], tree)
        finally:
            srv.stop()
    for attempt in range(3):  # a loaded machine can miss the cluster's first election
        try:
            cluster = NatsCluster(s.nats_server_binary(), store / f"try{attempt}").start()
            break
        except SmrError as e:
            print(f"# {label}: {e}; a fresh cluster", flush=True)
    else:
        raise SystemExit("no NATS cluster came up in 3 tries")
    try:
        pids = [x.proc.pid for x in cluster.servers if x.proc]

        async def kill_leader(bus: Bus) -> str:
            info = await bus.js.stream_info(STREAM_REQUESTS)
            assert info.cluster is not None and info.cluster.leader
            victim = cluster.server_named(info.cluster.leader)
            cluster.kill(victim)
            return f"killed {info.cluster.leader} (leader of {STREAM_REQUESTS})"

        async def pause_leader(bus: Bus) -> str:
            """SIGSTOP past the election timeout (as the campaign's pause-nats)."""
            info = await bus.js.stream_info(STREAM_REQUESTS)
            assert info.cluster is not None and info.cluster.leader
            pid = cluster.server_named(info.cluster.leader).proc.pid  # type: ignore[union-attr]
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(PAUSE_S)
            os.kill(pid, signal.SIGCONT)
            return f"paused {info.cluster.leader} (leader of {STREAM_REQUESTS}) {PAUSE_S:.0f}s"

        async def restart_all(bus: Bus) -> str:
            """Every server stopped, then all started again on their stores."""
            for x in cluster.servers:
                x.stop()
            await asyncio.to_thread(cluster.start)
            return "restarted the whole cluster (every server stopped, then started)"

        faults = {"cluster-kill": kill_leader, "cluster-pause": pause_leader,
                  "cluster-restart": restart_all}
        # The killed server's VmHWM is gone with it: the survivors' are printed.
        return await one_wave(label, cluster.url, 3, a, work, pids, tree,
                              kill=faults.get(kind))
    finally:
        cluster.stop()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=50)
    ap.add_argument("--pods", type=int, default=20)
    ap.add_argument("--delay", type=float, default=0.05, help="the stand-in's step, seconds")
    ap.add_argument("--concurrency", type=int, default=4, help="steps at once per node")
    ap.add_argument("--standin-procs", type=int, default=4,
                    help="processes the stand-ins are spread over")
    ap.add_argument("--spread", type=float, default=1.0, help="seconds the cordons span")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--waves", default="single,cluster,cluster-kill",
                    help=f"some of {','.join(WAVES)}")
    ap.add_argument("--keep", default="", help="a directory for the logs and stores (kept)")
    ap.add_argument("--base", default="", help="a commit (or a directory holding another "
                    "tree) whose services and stand-ins run each wave too, in turns with "
                    "this tree's")
    # The stand-ins' own process (one_wave starts it).
    ap.add_argument("--standin", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--replicas", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--standin-nodes", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.standin:
        await standins(a)
        return
    # Only the nats-server binary is read here (SMR_NATS_SERVER where it is not in .tools).
    s = config.load({k: v for k, v in os.environ.items() if k == "SMR_NATS_SERVER"})
    total = a.nodes * a.pods
    waves: list[Wave] = []
    todo = a.waves.split(",")
    with tempfile.TemporaryDirectory() as d:
        work = Path(a.keep or d)
        trees = [("", REPO)]
        base = Path(a.base)
        if a.base and base.is_dir():  # a copy of another commit (where there is no git)
            trees = [(f" {base.name}", base), (f" {REPO.name}", REPO)]
        elif a.base:
            base = Path(d) / "base"
            git("worktree", "add", "-q", "--detach", str(base), a.base)
            head = git("rev-parse", "--short", "HEAD")
            dirty = git("status", "--porcelain", "--untracked-files=no")
            trees = [(f" {a.base[:7]}", base), (f" {head}{'+' if dirty else ''}", REPO)]
        try:
            for kind in [w for w in WAVES if w in todo]:
                for name, tree in trees:
                    waves.append(await fresh_wave(kind, kind + name, a, work, tree, s))
                    # As it ends: a run cut short still says what it measured.
                    print(f"# {waves[-1].label}: " + " ".join(row(waves[-1], total)),
                          flush=True)
        finally:
            if a.base and not Path(a.base).is_dir():
                git("worktree", "remove", "--force", str(base))
    print(f"reclaim wave: {a.nodes} nodes x {a.pods} opted-in pods = {total} ckpt.requested, "
          f"cordons spread over {a.spread}s; STAND-IN checkpointers: {a.delay}s per step, "
          f"{a.concurrency} at once per node, in {a.standin_procs} processes")
    cols = ["held p50", "held p99", "step p50", "step p99", "step max", "last step",
            "last done", "watcher MiB", "nats MiB", "done", "lost", "doubled"]
    width = max([13, *(len(w.label) + 1 for w in waves)])
    print(f"{'':{width}}" + "".join(f"{c:>12}" for c in cols))
    for w in waves:
        print(f"{w.label:{width}}" + "".join(f"{c:>12}" for c in row(w, total)))
    for w in waves:
        if w.killed:
            tail = sorted(w.latency)[-10:]
            print(f"{w.label}: {w.killed} once {total // 2} ckpt.done were recorded; "
                  f"longest time after the kill with no step starting: {w.pause():.2f}s; "
                  f"latency tail (10 slowest, s): {' '.join(f'{x:.2f}' for x in tail)}")
    print("seconds; held: per request, its node's cordon -> an observing JetStream consumer "
          "holds it (as bench/watcher.py); step: its node's cordon -> its stand-in's step "
          "starts (the node's durable consumer fetched it, the Worker claimed its step "
          "state); last step / last done: first cordon -> the last step started / the last "
          "ckpt.done seen; doubled: steps run twice; MiB: peak RSS (VmHWM); each "
          "wave has fresh servers, a killed one is not listed")


if __name__ == "__main__":
    asyncio.run(main())
