"""The `smr` command line. `checkpoint` and `restore` publish a request (the
services do the work; the command shows progress and the result); `exec`,
`kill`, `ps` and `up` act on this machine; the others are the services."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import shutil
import signal
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Only what parsing and `smr up`'s lock need: the rest is imported by the
# command that uses it (two seconds of imports), after `smr up` holds its
# data directory, so that a command started beside it finds it starting.
from smr import config, config_docs
from smr.contract.errors import SmrError
from smr.process import sockets
from smrctl import args, uplock

if TYPE_CHECKING:
    from smr.bus import Bus
    from smr.contract.messages import CkptDone, CkptRequested, RestoreDone, RestoreRequested


def _progress_printer() -> Any:
    from smrctl.status import fmt_bytes

    start = time.monotonic()
    tty = sys.stderr.isatty()
    last = [""]

    def show(st: dict[str, Any]) -> None:
        done, total = st.get("done_bytes") or 0, st.get("total_bytes")
        amount = fmt_bytes(done) + (f" / {fmt_bytes(total)}" if total else "")
        line = f"  {st.get('phase', '...')}: {amount} ({time.monotonic() - start:.1f}s)"
        if tty:
            print("\r" + line.ljust(60), end="", file=sys.stderr, flush=True)
        elif st.get("phase") != last[0]:
            print(line, file=sys.stderr, flush=True)
        last[0] = st.get("phase", "")

    return show


def _report(result: CkptDone | RestoreDone, what: str) -> int:
    from smr.contract.messages import CkptDone, RestoreDone
    from smrctl.status import fmt_bytes

    if sys.stderr.isatty():
        print("\r".ljust(62), end="\r", file=sys.stderr)
    if result.status == "succeeded":
        took = result.durations.get("total")
        extra = f", pid {result.pid}" if isinstance(result, RestoreDone) else ""
        print(f"{what} {result.checkpoint_id}: generation {result.generation}, "
              f"{fmt_bytes(result.size_bytes)}"
              + (f" in {took:.2f}s" if took else "") + extra)
        if isinstance(result, CkptDone) and result.pre_dump_skipped:
            print(f"  no pre-dump: {result.pre_dump_skipped}; the dump was a full one")
        if result.location:
            print(f"  stored at {result.location}")
        if held := sockets.summary(result.sockets, restored=isinstance(result, RestoreDone)):
            print(f"  sockets: {held}")
        return 0
    err = result.error or {}
    print(f"{what} {result.checkpoint_id} failed: {err.get('message', '?')}", file=sys.stderr)
    if err.get("detail"):
        print(f"  {err['detail']}", file=sys.stderr)
    if err.get("hint"):
        print(f"  hint: {err['hint']}", file=sys.stderr)
    return 1


async def _wait(s: config.Settings, bus: Bus, rid: str, kind: str, what: str,
                timeout: float) -> int:
    try:
        result = await uplock.while_up_holds(s, bus.wait_result(
            rid, kind, timeout=timeout, on_progress=_progress_printer()))
    except uplock.UpStopped as e:
        # Its NATS went with it: waiting on would reconnect to nothing. The
        # request is stored, and the next `smr up` takes it up.
        print(f"{what}: {e} while this command waited for the {what}'s result "
              f"(request {rid})", file=sys.stderr)
        print(f"  hint: a request it had not finished stays queued and the next `smr up` runs "
              f"it; the same command again with `--request-id {rid}` then waits for its "
              "result and runs nothing twice", file=sys.stderr)
        return 3
    except TimeoutError:
        if sys.stderr.isatty():
            print("\r".ljust(62), end="\r", file=sys.stderr)
        # Only the waiting ends: the request stays in the queue and its step
        # runs on, so the user must not take this for a failure and ask again.
        print(f"{what}: no result within {timeout:g}s; the {what} goes on (request {rid})",
              file=sys.stderr)
        print(f"  hint: `smr status` shows its progress and outcome; waiting again with "
              f"`--request-id {rid}` runs nothing twice", file=sys.stderr)
        return 3
    return _report(result, what)


# -- commands -------------------------------------------------------------------------

async def cmd_up(s: config.Settings, a: argparse.Namespace) -> int:
    from smr import metrics
    from smr.aio import dump_tasks_on_signal, ended_why, until_stopped
    from smrctl import embedded

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    dump_tasks_on_signal()
    async with embedded.EmbeddedNode(s, held=a.held) as node:
        served = None
        if s.metrics_port:
            try:
                served = await metrics.serve(s.metrics_port, "127.0.0.1")
            except OSError as e:  # another `smr up`, or anything else, holds the port
                print(f"  no metrics: port {s.metrics_port}: {e.strerror} (set SMR_METRICS_PORT)",
                      flush=True)
        print(f"smr up: node {s.node}, NATS {node.url}, data {s.data_path}", flush=True)
        if served:
            print(f"  metrics on http://127.0.0.1:{s.metrics_port}/metrics", flush=True)
        if node.criu_problem:
            print(f"  WARNING: {node.criu_problem}", flush=True)
        print(f"  checkpoints in {s.storage_root}; Ctrl-C stops", flush=True)
        if ended := await until_stopped(stop, node.tasks):
            # Up but not serving is the worst state: exit, so that whatever
            # runs `smr up` (systemd, a supervisor) starts it again.
            print(f"smr up: a service of node {s.node} ended on its own ({ended_why(ended)});"
                  " stopping so that it is restarted", file=sys.stderr, flush=True)
            if served:
                await served.cleanup()
            return 1
        print("smr: stopping", flush=True)
        if served:
            await served.cleanup()
    return 0


async def cmd_node_consumers(s: config.Settings, a: argparse.Namespace) -> int:
    """The operator's step for `smr up` on a shared NATS: each machine's
    request durables, which its own user may not create (docs/security.md)."""
    from smrctl import embedded, reach

    bus = await reach.connect(s)
    try:
        for node in a.nodes:
            await bus.make_node_consumers(node, embedded.windows(s))
            print(f"node {node}: request consumers made", flush=True)
    finally:
        await bus.close()
    return 0


async def cmd_exec(s: config.Settings, a: argparse.Namespace) -> int:
    if not a.cmd:
        raise SmrError("no command given", hint="smr exec -i ID -- CMD [ARGS...]")
    from smr.bus import KV_JOBS, KV_LOCKS, KV_STEPS
    from smr.gpu import coopgate
    from smr.jobs import JobChanged, JobLock, JobRegistry, gpu_env, job_key, launch, signal_tree
    from smrctl import reach

    bus = await reach.connect(s)
    # Under the job's lock, as its checkpoints and restores: a restore of
    # this id in progress is waited for, then seen running.
    lock = JobLock(bus.kv(KV_LOCKS), bus.kv(KV_STEPS), wait_s=s.lock_wait)
    request = f"exec-{uuid.uuid4().hex}"
    try:
        await lock.acquire(a.id, request, lambda holder: print(
            f"job {a.id} is busy with request {holder}; waiting", file=sys.stderr))
        jobs = JobRegistry(bus.kv(KV_JOBS), job_key(s.job_key_path))
        jobs.check_writable(a.id)  # before anything is started
        old, revision = await jobs.read(a.id)
        if old and old.alive():
            raise SmrError(f"job {a.id} is already running (pid {old.pid})", code="job-exists",
                           hint="choose another id")
        _runnable(a.cmd[0])
        log = Path(a.log) if a.log else s.data_path / "logs" / f"{a.id}.log"
        if a.gpus and not a.gpu:
            raise SmrError("--gpus is for a GPU job", code="invalid-gpus",
                           hint="smr exec --gpu --gpus N -i ID -- CMD")
        env = gpu_env(os.environ, a.gpus) if a.gpu else dict(os.environ)
        # Where a job that imports smr.coop meets smr's checkpoints (smr.gpu.coopgate).
        coop = coopgate.directory(s.work_path, a.id)
        shutil.rmtree(coop, ignore_errors=True)  # a former job's ranks are not this one's
        env[coopgate.ENV] = str(coop)
        job = launch(a.id, a.cmd, log=log.resolve(), cwd=Path.cwd(), node=s.node,
                     own_pid_namespace=not a.gpu, env=env)
        job.tcp = a.tcp
        try:
            # Only over the record read above: a restore that took the lock
            # over meanwhile (ours holds no step) and recorded its process
            # keeps its record, and this launch is undone.
            await jobs.replace(job, revision)
        except JobChanged:
            signal_tree(job.pid, signal.SIGKILL)
            now = await jobs.find(a.id)
            raise SmrError(f"job {a.id} was written by another while it started"
                           + (f" (now pid {now.pid}, {now.observed_state()})" if now else "")
                           + "; the command was ended", code="job-exists",
                           hint="`smr ps` shows it; choose another id") from None
        except BaseException:
            signal_tree(job.pid, signal.SIGKILL)  # unrecorded, no checkpoint could find it
            raise
        print(f"job {a.id} started: pid {job.pid}, log {job.log}")
        return 0
    finally:
        await lock.release(a.id, request)
        await bus.close()


def _runnable(program: str) -> None:
    """Refuse, before anything is recorded, a command that cannot start: the
    job's own start would only say so in its log, after `exec` said "started"."""
    if "/" in program:
        ok = os.path.isfile(program) and os.access(program, os.X_OK)
    else:
        ok = shutil.which(program) is not None
    if not ok:
        raise SmrError(f"cannot run {program}: no such executable "
                       + ("file" if "/" in program else "on PATH"), code="command-not-found",
                       hint="check the command's path (relative paths start from the "
                       "current directory) and that it is executable")


async def cmd_ps(s: config.Settings, a: argparse.Namespace) -> int:
    from smr.bus import KV_JOBS
    from smr.jobs import JobRegistry, job_key
    from smrctl import reach

    bus = await reach.connect(s)
    try:
        jobs = await JobRegistry(bus.kv(KV_JOBS), job_key(s.job_key_path)).all(
            await bus.kv_keys(KV_JOBS))
    finally:
        await bus.close()
    print(f"{'ID':<20} {'STATE':<13} {'PID':>8} {'GEN':>4}  COMMAND")
    for j in jobs:
        print(f"{j.id:<20} {j.observed_state():<13} {j.pid:>8} {j.generation or '-':>4}  "
              f"{shlex.join(j.cmd)[:60]}")
    return 0


async def _request(s: config.Settings, a: argparse.Namespace,
                   req: CkptRequested | RestoreRequested, what: str) -> int:
    """Publish a request; with --wait, show its progress and result."""
    from smrctl import reach

    bus = await reach.connect(s)
    try:
        ack = await bus.publish(req)
        print(f"{what} of {a.id} requested ({req.request_id}"
              + (", a repeat" if ack.duplicate else "") + ")", file=sys.stderr)
        if not a.wait:
            return 0
        return await _wait(s, bus, req.request_id, req.SCHEMA, what, a.timeout)
    finally:
        await bus.close()


async def cmd_checkpoint(s: config.Settings, a: argparse.Namespace) -> int:
    from smr.contract.messages import CkptRequested, Target

    return await _request(s, a, CkptRequested(
        request_id=a.request_id or uuid.uuid4().hex, checkpoint_id=a.id,
        target=Target.job(a.id), node=s.node, reason="api",
        leave_running=a.leave_running, pre_dump=a.pre_dump,
        tcp="close" if a.close_connections else None), "checkpoint")


async def cmd_restore(s: config.Settings, a: argparse.Namespace) -> int:
    from smr.contract.messages import RestoreRequested, Target

    return await _request(s, a, RestoreRequested(
        request_id=a.request_id or uuid.uuid4().hex, checkpoint_id=a.id,
        target=Target.job(a.as_id or a.id), node=s.node, reason="api",
        generation=a.generation, gpus=a.gpus), "restore")


async def cmd_checkpoints(s: config.Settings, a: argparse.Namespace) -> int:
    from services.storage.layout import LOCAL_NAMESPACE
    from services.storage.settings import make_store
    from smr.contract.messages import epoch
    from smrctl.status import fmt_bytes

    gens = await make_store(s).generations(LOCAL_NAMESPACE, a.id)
    if not gens:
        print(f"no checkpoints of {a.id}", file=sys.stderr)
        return 1
    print(f"{'GEN':>4} {'SIZE':>10}  {'TAKEN':<20} {'REASON':<12} LOCATION")
    for g in gens:
        m = g.manifest
        taken = datetime.fromtimestamp(epoch(m["created_at"]), UTC)
        print(f"{g.number:>4} {fmt_bytes(g.size_bytes):>10}  "
              f"{taken:%Y-%m-%d %H:%M:%S}  {m.get('reason', '-'):<12} {g.location}")
    return 0


async def cmd_status(s: config.Settings, a: argparse.Namespace) -> int:
    import orjson

    from smrctl import reach, status

    bus = await reach.connect(s)
    try:
        st = await status.gather(bus, namespace=a.namespace, failures=a.failures)
    finally:
        await bus.close()
    print(orjson.dumps(st, option=orjson.OPT_INDENT_2).decode() if a.json else status.render(st))
    return 0


async def cmd_kill(s: config.Settings, a: argparse.Namespace) -> int:
    from smr.bus import KV_JOBS
    from smr.jobs import JobRegistry, job_key
    from smrctl import reach

    bus = await reach.connect(s)
    try:
        job, _ = await JobRegistry(bus.kv(KV_JOBS), job_key(s.job_key_path)).get(a.id)
    finally:
        await bus.close()
    if not job.alive():
        print(f"job {a.id} is not running")
        return 0
    # The job is its PID namespace's init: killing it ends every process inside.
    os.kill(job.pid, signal.SIGKILL)
    print(f"job {a.id} (pid {job.pid}) killed")
    return 0


async def cmd_demo(s: config.Settings, a: argparse.Namespace) -> int:
    from smrctl.demo import run_demo

    return await run_demo(s, mib=a.mib, keep=a.keep)


async def cmd_service(s: config.Settings, a: argparse.Namespace) -> int:
    """``smr watcher|agent|storage``: one cluster service (deploy/kustomize)."""
    import importlib

    from smr import serve

    module = importlib.import_module(f"services.{a.command}.__main__")
    await serve.serve(a.command, s, module.make, needs_bus=getattr(module, "NEEDS_BUS", True),
                      buckets=getattr(module, "BUCKETS", None))
    return 0


def cmd_config(s: config.Settings, a: argparse.Namespace) -> int:
    if a.markdown:
        print(config_docs.markdown(), end="")
        return 0
    for st in config.SETTINGS:
        print(f"{config.PREFIX}{st.name}={config_docs.shown(st, s.values[st.name]):<24} # {st.doc}")
    return 0


COMMANDS = {
    "up": cmd_up, "exec": cmd_exec, "ps": cmd_ps, "checkpoint": cmd_checkpoint,
    "restore": cmd_restore, "checkpoints": cmd_checkpoints, "kill": cmd_kill,
    "status": cmd_status, "demo": cmd_demo, "node-consumers": cmd_node_consumers,
    "watcher": cmd_service, "agent": cmd_service, "storage": cmd_service,
    "webhook": cmd_service, "natsauth": cmd_service,
}


# Commands that run until stopped, whose log is their output.
SERVICES = {"up", "watcher", "agent", "storage", "webhook", "natsauth"}


def main(argv: list[str] | None = None) -> int:
    a = args.parser(__doc__).parse_args(argv)
    if a.command == "exec" and a.cmd[:1] == ["--"]:
        a.cmd = a.cmd[1:]
    # The long-running commands log what they do; a command that prints a
    # table or a result logs only what went wrong, unless -v asks for more.
    quiet = a.command not in SERVICES
    logging.basicConfig(level=logging.DEBUG if a.verbose else
                        logging.WARNING if quiet else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("nats").setLevel(logging.WARNING)
    try:
        s = config.load()
        if a.command == "config":
            return cmd_config(s, a)
        # `smr up` holds its data directory first thing: a command started
        # beside it (`smr up &` then `smr exec`) then finds it starting.
        a.held = uplock.hold_data_dir(s) if a.command == "up" else None
        return asyncio.run(COMMANDS[a.command](s, a))
    except SmrError as e:
        print(f"smr {a.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
