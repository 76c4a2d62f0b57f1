"""Programs nobody here wrote, in pod containers opted in by labels alone, on
the two-node harness: a heartbeat while a client is active, then 2
migrations (cordon, final checkpoint, the replacement on the other node) with
the program's own data checked after each.

PostgreSQL 15 in a pod container, opted in by labels alone: the image
holds the users, the host's /usr comes in read-only (hostPath) and the
cluster's files in a hostPath volume both nodes mount (a network volume's
part). Twice: the container drops to the postgres user as the official images
do (root, then setpriv); and the pod runs as that user (securityContext
runAsUser/runAsGroup/runAsNonRoot, the usual hardening), so that smr-init,
PID 1, is not root either. A client writes on a connection that lives through
a heartbeat; then 2 migrations, the committed rows (count and checksum)
checked after each, and pg_amcheck at the end.

What it needs of the agent: CRIU outside the container's IPC namespace, to
save PostgreSQL's System V segment with it; the container's /dev/shm (its
dynamic shared memory) carried with the checkpoint. About 30 s here.

Node.js (the host's, from /usr) in a pod that runs as nobody (runAsUser):
an HTTP server's Map and its setInterval timer, which must keep its rhythm.
About 25 s here.

A Python multiprocessing pool (ProcessPoolExecutor, 4 workers, a
multiprocessing.shared_memory block in the container's /dev/shm) as nobody
(runAsUser, as Node.js and the JVM):
the work in flight finishes, each task's result right, the block intact.
About 30 s here.

A JVM service (the host's OpenJDK 17) as nobody: its counter map, and no
second warm-up after a restore (the JIT's log). About 20 s here.

A Jupyter kernel (ipykernel on the host's Python) as root, with a client over
ZeroMQ: a numpy array and a half-consumed generator. About 20 s here.
"""

from __future__ import annotations

import asyncio
import functools
import http.client
import json
import os
import pwd
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipykernel
import jupyter_client
import psycopg
import pytest

from smr.contract.messages import CkptRequested, Target
from tests.agent.cluster import USR_IMAGE, Cluster, netns_pid
from tests.agent.test_injection import create, plain_pod
from tests.helpers.netns import in_netns
from tests.programs import jvm, pg, pool
from tests.programs import node as nodejs
from tests.programs.test_jupyter_local import CELLS
from tests.programs.test_jupyter_local import run as run_cell
from tests.programs.test_pool_local import DONE
from tests.programs.test_postgres_local import Rows

off_loop = asyncio.to_thread
CKPT = "pg-1"


def pg_pod(name: str, node: str, data: str, run_as_user: bool = False) -> dict[str, Any]:
    """run_as_user: the pod's securityContext makes the container postgres's
    (its ids in the image); else root drops to it with setpriv."""
    server = [str(pg.BIN / "postgres"), "-D", "/pg/data", "-p", "5432", "-k", "/pg",
              "-c", "listen_addresses=127.0.0.1"]
    p = plain_pod(name, node, image=USR_IMAGE, labels={"smr.dev/node-restore": "true"},
                  env={"SMR_CHECKPOINT": CKPT}, owner="pg", command=server if run_as_user
                  else ["/usr/bin/setpriv", *pg.as_postgres()[1:], *server])
    if run_as_user:
        pw = pwd.getpwnam(pg.USER)
        p["spec"]["securityContext"] = {"runAsUser": pw.pw_uid, "runAsGroup": pw.pw_gid,
                                        "runAsNonRoot": True}
    p["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "usr", "mountPath": "/usr", "readOnly": True},
        {"name": "pg", "mountPath": "/pg"}]
    p["spec"]["volumes"] = [{"name": "usr", "hostPath": {"path": "/usr"}},
                            {"name": "pg", "hostPath": {"path": data}}]
    return p


async def connect(cluster: Cluster, name: str, timeout: float = 30) -> psycopg.Connection:
    """A client in the pod's network namespace (as through its Service)."""
    deadline = time.monotonic() + timeout
    while True:
        p = cluster.kube.get("pods", name, "default")
        if p and (p.get("status") or {}).get("containerStatuses"):
            try:
                pid = netns_pid(cluster, name)
                return await off_loop(in_netns, pid, lambda: psycopg.connect(pg.dsn(5432)))
            except (psycopg.OperationalError, OSError, AssertionError, IndexError):
                pass
        assert time.monotonic() < deadline, (
            f"postgres in pod {name} never answered; log: "
            f"{cluster.log(name, p['spec']['nodeName'])[-2000:] if p else ''!r}")
        await asyncio.sleep(0.3)


def assert_tree_runs_as(cluster: Cluster, name: str, uid: int, gid: int) -> None:
    """The container's PID 1 (smr-init) and every process under it run as
    uid:gid (read from the host's /proc)."""
    todo, seen = [netns_pid(cluster, name)], []
    while todo:
        pid = todo.pop()
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # a process that ended meanwhile (a backend)
            assert seen, "the container's PID 1 is gone"
            continue
        ids = {k: v.split() for k, _, v in (ln.partition(":\t") for ln in status.splitlines())}
        assert ids["Uid"] == [str(uid)] * 4 and ids["Gid"] == [str(gid)] * 4, (pid, status)
        seen.append(ids["Name"][0])
    assert seen[0] == "smr-init" and len(seen) > 1, seen


async def check(cluster: Cluster, name: str, rows: Rows, ids: range, started: str,
                as_user: pwd.struct_passwd | None = None) -> None:
    """A new connection finds every committed row, and the server takes writes;
    the same postmaster, restored (the files alone would let a fresh start
    find the rows too: it would recover them from its WAL); with ``as_user``,
    in a container whose PID 1 is that user's."""
    conn = await connect(cluster, name)
    try:
        if as_user:
            assert_tree_runs_as(cluster, name, as_user.pw_uid, as_user.pw_gid)
        assert await off_loop(postmaster_started, conn) == started, "it started afresh"
        got = await off_loop(lambda: conn.execute(pg.SUMMARY).fetchone())
        assert got is not None and (int(got[0]), str(got[1])) == rows.summary()
        await off_loop(rows.insert, conn, ids)
        got = await off_loop(lambda: conn.execute(pg.SUMMARY).fetchone())
        assert got is not None and (int(got[0]), str(got[1])) == rows.summary()
    finally:
        conn.close()


def postmaster_started(conn: psycopg.Connection) -> str:
    row = conn.execute("SELECT pg_postmaster_start_time()::text").fetchone()
    assert row is not None
    return str(row[0])


async def migrate(cluster: Cluster, src: str, dst: str, node_a: str, node_b: str,
                  data: str, make: Callable[[str, str, str], dict[str, Any]] | None = None,
                  ckpt: str = CKPT) -> tuple[dict[str, Any], float]:
    """Cordon node a, its final checkpoint (a drain), the replacement on node b."""
    await cluster.core.patch_node(node_a, {"spec": {"unschedulable": True}})
    done = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=ckpt, node=node_a, reason="drain",
        target=Target(kind="pod", namespace="default", pod=src, container="main")),
        timeout=90)
    assert done.status == "succeeded", done.error
    cluster.kube.remove("pods", src, "default")
    t = time.monotonic()
    await create(cluster, (make or pg_pod)(dst, node_b, data))
    await cluster.event("Restored", dst, timeout=60)
    await cluster.core.patch_node(node_a, {"spec": {"unschedulable": False}})
    return {"size": done.size_bytes, "durations": done.durations}, time.monotonic() - t


@pytest.mark.parametrize("run_as_user", [False, True], ids=["setpriv", "runAsUser"])
async def test_postgres_pod_as_its_own_user_through_a_heartbeat_and_two_migrations(
        cluster: Cluster, run_as_user: bool) -> None:
    a, b = list(cluster.kubelets)
    make = functools.partial(pg_pod, run_as_user=run_as_user)
    # Names of their own: the watcher's Events of one variant's pods (on the
    # session's NATS) must not be taken for the other's.
    pg_a, pg_b, pg_c = (f"{'pgu' if run_as_user else 'pg'}-{x}" for x in "abc")
    with pg.cluster() as top:
        await create(cluster, make(pg_a, a, str(top)))
        conn = await connect(cluster, pg_a)
        as_user = pwd.getpwnam(pg.USER) if run_as_user else None
        if as_user:  # the kubelet's doing, not a setpriv: PID 1 is postgres's too
            assert_tree_runs_as(cluster, pg_a, as_user.pw_uid, as_user.pw_gid)
        rows = Rows()
        await off_loop(lambda: (conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)"),
                                conn.commit()))
        await off_loop(rows.insert, conn, range(0, 3000))
        backend = conn.info.backend_pid
        started = await off_loop(postmaster_started, conn)

        # A heartbeat: a checkpoint that leaves it running; the client goes on.
        beat = await cluster.bus.request(CkptRequested(
            request_id=uuid.uuid4().hex, checkpoint_id=CKPT, node=a, reason="heartbeat",
            leave_running=True, target=Target(kind="pod", namespace="default", pod=pg_a,
                                              container="main")), timeout=90)
        assert beat.status == "succeeded", beat.error
        await off_loop(rows.insert, conn, range(3000, 4000))
        assert conn.info.backend_pid == backend
        conn.close()

        first, took1 = await migrate(cluster, pg_a, pg_b, a, b, str(top), make)
        await check(cluster, pg_b, rows, range(4000, 4500), started, as_user)
        second, took2 = await migrate(cluster, pg_b, pg_c, b, a, str(top), make)
        await check(cluster, pg_c, rows, range(4500, 5000), started, as_user)

        amcheck = await off_loop(in_netns, netns_pid(cluster, pg_c),
                                 lambda: pg.amcheck(5432))
        assert amcheck.returncode == 0, amcheck.stdout + amcheck.stderr
        numbers = dict(heartbeat={"size": beat.size_bytes, "durations": beat.durations},
                       first=first, first_restored_s=took1, second=second,
                       second_restored_s=took2)
        mode = "runAsUser" if run_as_user else "setpriv"
        print(f"\n[compat] postgres pod non-root ({mode}): "
              f"{json.dumps(numbers, default=str)}")


NODE_CKPT = "node-1"


NOBODY = {"runAsUser": 65534, "runAsGroup": 65534, "runAsNonRoot": True}


def node_pod(name: str, node: str, _: str = "") -> dict[str, Any]:
    """As nobody through the pod's securityContext: smr-init too."""
    p = plain_pod(name, node, image=USR_IMAGE, labels={"smr.dev/node-restore": "true"},
                  env={"SMR_CHECKPOINT": NODE_CKPT}, owner="node", command=[
                      "/usr/bin/node", "/app/server.js", "8080", "0.0.0.0"])
    p["spec"]["securityContext"] = dict(NOBODY)
    p["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "usr", "mountPath": "/usr", "readOnly": True}]
    p["spec"]["volumes"] = [{"name": "usr", "hostPath": {"path": "/usr"}}]
    return p


def pod_socket(pid: int) -> socket.socket:
    """A connection to port 8080 in the network namespace of ``pid``."""
    return in_netns(pid, lambda: socket.create_connection(("127.0.0.1", 8080), timeout=10))


async def node_get(cluster: Cluster, name: str, path: str = "/", timeout: float = 30
                   ) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        p = cluster.kube.get("pods", name, "default")
        if p and (p.get("status") or {}).get("containerStatuses"):
            try:
                return await off_loop(nodejs.get, 8080, path,
                                      functools.partial(pod_socket, netns_pid(cluster, name)))
            except (OSError, AssertionError, IndexError, http.client.HTTPException):
                pass
        assert time.monotonic() < deadline, f"node in pod {name} never answered"
        await asyncio.sleep(0.2)


async def test_nodejs_pod_as_nobody_keeps_its_map_and_timer_through_two_migrations(
        cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    await create(cluster, node_pod("node-a", a))
    for k in ("x", "y", "x"):
        await node_get(cluster, "node-a", f"/inc/{k}")
    assert_tree_runs_as(cluster, "node-a", 65534, 65534)
    # A client with a keep-alive connection, active through the heartbeat.
    pid = netns_pid(cluster, "node-a")
    conn = http.client.HTTPConnection("127.0.0.1", 8080, timeout=10)
    conn.sock = await off_loop(pod_socket, pid)

    def inc(key: str) -> dict[str, Any]:
        conn.request("GET", f"/inc/{key}")
        return json.loads(conn.getresponse().read())  # type: ignore[no-any-return]

    assert (await off_loop(inc, "z"))["counts"] == {"x": 2, "y": 1, "z": 1}
    beat = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=NODE_CKPT, node=a, reason="heartbeat",
        leave_running=True, target=Target(kind="pod", namespace="default", pod="node-a",
                                          container="main")), timeout=90)
    assert beat.status == "succeeded", beat.error
    assert (await off_loop(inc, "z"))["counts"]["z"] == 2, "the same connection goes on"
    conn.close()

    want = {"x": 2, "y": 1, "z": 2}
    numbers: dict[str, Any] = {"heartbeat": {"size": beat.size_bytes,
                                             "durations": beat.durations}}
    for src, dst, n_from, n_to in (("node-a", "node-b", a, b), ("node-b", "node-c", b, a)):
        before, t = (await node_get(cluster, src))["ticks"], time.monotonic()
        done, took = await migrate(cluster, src, dst, n_from, n_to, "", node_pod, NODE_CKPT)
        state = await node_get(cluster, dst)
        nodejs.assert_timer_kept_its_rhythm(before, state["ticks"], time.monotonic() - t)
        assert_tree_runs_as(cluster, dst, 65534, 65534)
        assert state["counts"] == want
        want["x"] += 1
        assert (await node_get(cluster, dst, "/inc/x"))["counts"] == want
        numbers[dst] = {**done, "restored_s": took}
    print(f"\n[compat] nodejs pod non-root: {json.dumps(numbers, default=str)}")


POOL_CKPT, POOL_TASKS, POOL_MIB = "pool-1", 32, 16


def pool_pod(name: str, node: str, _: str = "") -> dict[str, Any]:
    p = plain_pod(name, node, image=USR_IMAGE, labels={"smr.dev/node-restore": "true"},
                  env={"SMR_CHECKPOINT": POOL_CKPT}, owner="pool", command=[
                      "/usr/bin/python3", "/app/pool.py", str(POOL_TASKS), str(POOL_MIB)])
    p["spec"]["securityContext"] = dict(NOBODY)
    p["spec"]["restartPolicy"] = "Never"
    p["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "usr", "mountPath": "/usr", "readOnly": True}]
    p["spec"]["volumes"] = [{"name": "usr", "hostPath": {"path": "/usr"}}]
    return p


async def until_done(cluster: Cluster, runs: list[tuple[str, str]], n: int,
                     timeout: float = 60) -> str:
    """The pods' logs, in order, once ``n`` tasks are reported done."""
    deadline = time.monotonic() + timeout
    while True:
        text = "".join(cluster.log(name, node) for name, node in runs)
        if len(DONE.findall(text)) >= n:
            return text
        assert time.monotonic() < deadline, f"{n} tasks never done: {text[-1500:]!r}"
        await asyncio.sleep(0.1)


async def test_pool_pod_as_nobody_finishes_its_work_through_two_migrations(
        cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    await create(cluster, pool_pod("pool-a", a))
    runs = [("pool-a", a)]
    await until_done(cluster, runs, 1)
    assert_tree_runs_as(cluster, "pool-a", 65534, 65534)
    beat = await cluster.bus.request(CkptRequested(
        request_id=uuid.uuid4().hex, checkpoint_id=POOL_CKPT, node=a, reason="heartbeat",
        leave_running=True, target=Target(kind="pod", namespace="default", pod="pool-a",
                                          container="main")), timeout=90)
    assert beat.status == "succeeded", beat.error
    numbers: dict[str, Any] = {"heartbeat": {"size": beat.size_bytes,
                                             "durations": beat.durations}}
    for src, dst, n_from, n_to, at in (("pool-a", "pool-b", a, b, 4),
                                       ("pool-b", "pool-c", b, a, 12)):
        await until_done(cluster, runs, at)
        done, took = await migrate(cluster, src, dst, n_from, n_to, "", pool_pod, POOL_CKPT)
        runs.append((dst, n_to))
        assert_tree_runs_as(cluster, dst, 65534, 65534)
        in_flight = POOL_TASKS - len(DONE.findall(
            "".join(cluster.log(name, node) for name, node in runs)))
        assert in_flight > 0, "the work was over before the migration: nothing in flight"
        numbers[dst] = {**done, "restored_s": took, "in_flight": in_flight}
    text = await until_done(cluster, runs, POOL_TASKS)
    deadline = time.monotonic() + 30
    while f"finished {POOL_TASKS}" not in text:
        assert time.monotonic() < deadline, text[-1500:]
        await asyncio.sleep(0.1)
        text = "".join(cluster.log(name, node) for name, node in runs)
    done_at = {int(i): d for i, d in DONE.findall(text)}
    assert sorted(done_at) == list(range(POOL_TASKS)), "tasks lost or doubled"
    assert all(d == pool.expected(i, POOL_TASKS, POOL_MIB) for i, d in done_at.items())
    assert "block ok" in text
    print(f"\n[compat] pool pod non-root: {json.dumps(numbers, default=str)}")


JVM_CKPT = "jvm-1"


def java_home() -> Path:
    """The JDK that `java` on PATH starts (Debian's, or another under /usr/lib/jvm):
    the pod runs that same one, found as tests/programs/jvm.py finds it."""
    return Path(os.path.realpath(jvm.java_cmd(Path("/classes"), 8080)[0])).parent.parent


def jdk_mounts(home: Path) -> list[str]:
    """The host folders the JDK needs besides itself: Debian's keeps its
    configuration under /etc (lib/jvm.cfg links there), other JDKs none."""
    out: set[str] = set()
    for link in (*home.iterdir(), *(home / "lib").iterdir()):
        if link.is_symlink() and (target := os.path.realpath(link)).startswith("/etc/"):
            out.add(os.path.dirname(target) if os.path.isfile(target) else target)
    return sorted(out)


def jvm_pod(name: str, node: str, classes: str) -> dict[str, Any]:
    home = java_home()
    p = plain_pod(name, node, image=USR_IMAGE, labels={"smr.dev/node-restore": "true"},
                  env={"SMR_CHECKPOINT": JVM_CKPT}, owner="jvm", command=[
                      str(home / "bin/java"),
                      *jvm.java_cmd(Path("/classes"), 8080, "0.0.0.0")[1:]])
    p["spec"]["securityContext"] = dict(NOBODY)
    hosts = ["/usr", *jdk_mounts(home), *([] if home.is_relative_to("/usr") else [str(home)])]
    p["spec"]["containers"][0]["volumeMounts"] = [
        *({"name": f"host{i}", "mountPath": h, "readOnly": True} for i, h in enumerate(hosts)),
        {"name": "classes", "mountPath": "/classes", "readOnly": True}]
    p["spec"]["volumes"] = [
        *({"name": f"host{i}", "hostPath": {"path": h}} for i, h in enumerate(hosts)),
        {"name": "classes", "hostPath": {"path": classes}}]
    return p


async def test_jvm_pod_as_nobody_keeps_its_map_and_compiled_code_through_two_migrations(
        cluster: Cluster) -> None:
    a, b = list(cluster.kubelets)
    with tempfile.TemporaryDirectory(prefix="smr-jvm-") as d:
        os.chmod(d, 0o755)
        classes = jvm.compile_server(Path(d) / "classes")
        for p in (classes, *classes.iterdir()):
            p.chmod(0o755 if p.is_dir() else 0o644)
        await create(cluster, jvm_pod("jvm-a", a, str(classes)))
        for i in range(300):  # warm-up: the JIT compiles Counter.work
            await node_get(cluster, "jvm-a", f"/inc/k{i % 3}")
        deadline = time.monotonic() + 60
        while not jvm.work_fully_compiled(cluster.log("jvm-a", a)):
            assert time.monotonic() < deadline, "Counter.work was never compiled by C2"
            await node_get(cluster, "jvm-a")
        pid = netns_pid(cluster, "jvm-a")
        conn = http.client.HTTPConnection("127.0.0.1", 8080, timeout=10)
        conn.sock = await off_loop(pod_socket, pid)

        def inc(key: str) -> dict[str, Any]:
            conn.request("GET", f"/inc/{key}")
            return json.loads(conn.getresponse().read())  # type: ignore[no-any-return]

        assert (await off_loop(inc, "k0"))["counts"]["k0"] == 101
        assert_tree_runs_as(cluster, "jvm-a", 65534, 65534)
        beat = await cluster.bus.request(CkptRequested(
            request_id=uuid.uuid4().hex, checkpoint_id=JVM_CKPT, node=a, reason="heartbeat",
            leave_running=True, target=Target(kind="pod", namespace="default", pod="jvm-a",
                                              container="main")), timeout=90)
        assert beat.status == "succeeded", beat.error
        assert (await off_loop(inc, "k0"))["counts"]["k0"] == 102, "the same client goes on"
        conn.close()

        want = {"k0": 102, "k1": 100, "k2": 100}
        numbers: dict[str, Any] = {"heartbeat": {"size": beat.size_bytes,
                                                 "durations": beat.durations}}
        for src, dst, n_from, n_to, n in (("jvm-a", "jvm-b", a, b, 1),
                                          ("jvm-b", "jvm-c", b, a, 2)):
            done, took = await migrate(cluster, src, dst, n_from, n_to, str(classes),
                                       jvm_pod, JVM_CKPT)
            first = await node_get(cluster, dst)
            assert first["counts"] == want
            assert_tree_runs_as(cluster, dst, 65534, 65534)
            want["k1"] += 1
            assert (await node_get(cluster, dst, "/inc/k1"))["counts"] == want
            deadline = time.monotonic() + 30
            # Its log gets compilations: of a method first called in this replacement.
            while not jvm.cold(n).search(cluster.log(dst, n_to)):
                assert time.monotonic() < deadline, "no compilation logged after the restore"
                await node_get(cluster, dst, f"/cold{n}")
            assert not jvm.compilations_of_work(cluster.log(dst, n_to)), (
                "Counter.work was compiled again after the restore: a second warm-up")
            numbers[dst] = {**done, "restored_s": took, "work_ns_first": first["work_ns"]}
        print(f"\n[compat] jvm pod non-root: {json.dumps(numbers, default=str)}")


KERNEL_CKPT = "kernel-1"


def kernel_pod(name: str, node: str, conn_dir: str) -> dict[str, Any]:
    """ipykernel on the host's Python 3.11, its packages from this Python's
    site directory (hostPath), as root (it writes its profile under $HOME)."""
    site = str(Path(ipykernel.__file__).resolve().parents[1])
    p = plain_pod(name, node, image=USR_IMAGE, labels={"smr.dev/node-restore": "true"},
                  env={"SMR_CHECKPOINT": KERNEL_CKPT, "PYTHONPATH": "/site", "HOME": "/root"},
                  owner="kernel", command=["/usr/bin/python3", "-m", "ipykernel_launcher",
                                           "-f", "/conn/kernel.json"])
    p["spec"]["containers"][0]["volumeMounts"] = [
        {"name": "usr", "mountPath": "/usr", "readOnly": True},
        {"name": "site", "mountPath": "/site", "readOnly": True},
        {"name": "conn", "mountPath": "/conn", "readOnly": True}]
    p["spec"]["volumes"] = [{"name": "usr", "hostPath": {"path": "/usr"}},
                            {"name": "site", "hostPath": {"path": site}},
                            {"name": "conn", "hostPath": {"path": conn_dir}}]
    return p


def pod_kernel_client(cluster: Cluster, name: str, conn_file: Path) -> Any:
    """A jupyter_client client in the pod's network namespace: its ZeroMQ
    context's I/O threads (which make the connections) are started by a thread
    that joined it, and a thread's children stay in its namespace."""
    import zmq

    def context() -> zmq.Context[Any]:
        ctx: zmq.Context[Any] = zmq.Context()
        ctx.socket(zmq.PUB).close()  # libzmq starts its I/O threads with the first socket
        return ctx

    ctx = in_netns(netns_pid(cluster, name), context)
    kc = jupyter_client.BlockingKernelClient(connection_file=str(conn_file), context=ctx)
    kc.load_connection_file()
    # The client's heartbeat gives a kernel 1 s to answer before calling it
    # dead: a loaded 2-core VM misses that while the kernel is alive.
    kc.hb_channel.time_to_dead = 10.0
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    return kc


async def kernel_client(cluster: Cluster, name: str, conn_file: Path,
                        timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        p = cluster.kube.get("pods", name, "default")
        if p and (p.get("status") or {}).get("containerStatuses"):
            try:
                return await off_loop(pod_kernel_client, cluster, name, conn_file)
            except (OSError, AssertionError, IndexError, RuntimeError):
                pass
        assert time.monotonic() < deadline, (
            f"kernel in pod {name} never answered: "
            f"{cluster.log(name, p['spec']['nodeName'])[-1500:] if p else ''!r}")
        await asyncio.sleep(0.5)


async def test_jupyter_kernel_pod_keeps_its_variables_through_two_migrations(
        cluster: Cluster, tmp_path: Path) -> None:
    a, b = list(cluster.kubelets)
    with tempfile.TemporaryDirectory(prefix="smr-kernel-") as d:
        os.chmod(d, 0o755)
        conn_file = Path(d) / "kernel.json"
        jupyter_client.connect.write_connection_file(
            str(conn_file), ip="127.0.0.1", key=uuid.uuid4().hex.encode(), shell_port=50001,
            iopub_port=50002, stdin_port=50003, control_port=50004, hb_port=50005)
        conn_file.chmod(0o644)
        await create(cluster, kernel_pod("kernel-a", a, d))
        kc = await kernel_client(cluster, "kernel-a", conn_file)
        got = await off_loop(run_cell, kc, CELLS, first="first")
        assert got == {"first": "[0, 1, 4]"}
        beat = await cluster.bus.request(CkptRequested(
            request_id=uuid.uuid4().hex, checkpoint_id=KERNEL_CKPT, node=a,
            reason="heartbeat", leave_running=True, target=Target(
                kind="pod", namespace="default", pod="kernel-a", container="main")),
            timeout=90)
        assert beat.status == "succeeded", beat.error
        got = await off_loop(run_cell, kc, "b = a * 2", b="int(b.sum())", g="next(g)")
        assert got == {"b": str(2 * sum(range(1_000_000))), "g": "9"}, "the same client"
        kc.stop_channels()

        numbers: dict[str, Any] = {"heartbeat": {"size": beat.size_bytes,
                                                 "durations": beat.durations}}
        for src, dst, n_from, n_to, g in (("kernel-a", "kernel-b", a, b, 16),
                                          ("kernel-b", "kernel-c", b, a, 25)):
            done, took = await migrate(cluster, src, dst, n_from, n_to, d, kernel_pod,
                                       KERNEL_CKPT)
            again = await kernel_client(cluster, dst, conn_file)  # the same ports
            try:
                got = await off_loop(run_cell, again, "", a="int(a.sum())", g="next(g)",
                                     first="first")
            finally:
                again.stop_channels()
            assert got == {"a": str(sum(range(1_000_000))), "g": str(g),
                           "first": "[0, 1, 4]"}
            numbers[dst] = {**done, "restored_s": took}
        print(f"\n[compat] jupyter kernel pod root: {json.dumps(numbers, default=str)}")
