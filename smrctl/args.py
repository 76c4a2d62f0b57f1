"""The `smr` command line's arguments: every command, its options and the
checks a value passes before anything is asked of smr (smrctl/cli.py runs
the commands)."""

from __future__ import annotations

import argparse

from smr.gpu.gpupairs import GPU_UUID
from smr.process import sockets


def generation(text: str) -> int:
    """``--generation N``: a stored generation's number; they count from 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: generations are numbered from 1 (`smr checkpoints ID` lists them); "
            "leave --generation out for the latest")
    return n


def gpu_list(text: str) -> list[str]:
    """``--gpus UUID[,UUID]``: GPU UUIDs as nvidia-smi -L prints them, each once."""
    uuids = [u.strip() for u in text.split(",") if u.strip()]
    bad = [u for u in uuids if not GPU_UUID.fullmatch(u)]
    if not uuids or bad:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad) or repr(text)}: not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-"
            "xxxxxxxxxxxx, as nvidia-smi -L prints it)")
    if len(set(uuids)) != len(uuids):
        raise argparse.ArgumentTypeError(f"{text}: a GPU named twice")
    return uuids


def parser(cli_doc: str | None = None) -> argparse.ArgumentParser:
    """Every command and its arguments; ``cli_doc`` heads `smr --help`."""
    p = argparse.ArgumentParser(prog="smr", description=cli_doc)
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log at DEBUG (default: commands log warnings only, `up` and the "
                   "services INFO)")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="run NATS, checkpointer, restorer and storage on this machine")
    e = sub.add_parser("exec", help="start a managed job")
    e.add_argument("-i", "--id", required=True)
    e.add_argument("--log", help="output file (default: DATA_DIR/logs/ID.log)")
    e.add_argument("--gpu", action="store_true",
                   help="a CUDA job: runs without its own PID namespace (CUDA fails in one), "
                   "with TORCHINDUCTOR_COMPILE_THREADS=1 unless its environment sets it")
    e.add_argument("--gpus", metavar="N|LIST",
                   help="with --gpu: the GPUs it sees (CUDA_VISIBLE_DEVICES): N, the first N, "
                   "or a list of indices or UUIDs; a process that sees one GPU is checkpointable "
                   "on driver 580, one on several is refused when it holds them (docs/gpu.md)")
    e.add_argument("--tcp", choices=sockets.POLICIES, default="auto",
                   help="its established TCP connections at a checkpoint: auto (kept where "
                   "they can go on, closed on a migration) or close (always closed)")
    e.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("ps", help="list jobs")
    c = sub.add_parser("checkpoint", help="checkpoint a job")
    c.add_argument("id")
    c.add_argument("--leave-running", action="store_true", help="keep it running afterwards")
    c.add_argument("--pre-dump", action="store_true",
                   help="copy memory while the job runs, then dump what changed: a shorter "
                   "freeze (the job still stops unless --leave-running); where the kernel "
                   "cannot track dirty memory, a full dump, said with the result")
    c.add_argument("--close-connections", action="store_true",
                   help="close its TCP connections instead of keeping them (it will resume "
                   "on another machine: peers see a reset now and reconnect)")
    r = sub.add_parser("restore", help="restore a job from its checkpoint")
    r.add_argument("id", help="the checkpoint id (the job id it was taken from)")
    r.add_argument("--generation", type=generation, help="default: the latest")
    r.add_argument("--as", dest="as_id", help="run the restored job under this id")
    r.add_argument("--gpus", type=gpu_list, metavar="UUID[,UUID]",
                   help="restore its GPU state onto these GPUs of this node, paired in "
                   "order with the GPUs it was checkpointed on (default: those, where this "
                   "node has them with room; else others of the same model); driver 580")
    for q in (c, r):
        q.add_argument("--wait", action=argparse.BooleanOptionalAction, default=True,
                       help="wait for the result, showing progress (default)")
        q.add_argument("--timeout", type=float, default=900.0)
        q.add_argument("--request-id", help="idempotency key (default: random)")
    ls = sub.add_parser("checkpoints", help="list stored generations of a checkpoint")
    ls.add_argument("id")
    st = sub.add_parser("status", help="protected workloads and their latest checkpoint, "
                        "running requests with their progress, recent failures")
    st.add_argument("-n", "--namespace", help="only this namespace's checkpoints, running "
                    "requests and failures (`local`: the jobs of `smr up`)")
    st.add_argument("--failures", type=int, default=5, help="how many recent failures to show")
    st.add_argument("--json", action="store_true", help="print the facts as JSON")
    k = sub.add_parser("kill", help="kill a job")
    k.add_argument("id")
    d = sub.add_parser("demo", help="checkpoint, kill and restore a sample stateful job")
    d.add_argument("--mib", type=int, default=256, help="memory the sample job holds")
    d.add_argument("--keep", action="store_true", help="keep its checkpoint, log and job")
    cf = sub.add_parser("config", help="print the settings in force")
    cf.add_argument("--markdown", action="store_true", help="print every setting and the "
                    "variables read elsewhere as docs/configuration.md (defaults, not values)")
    nc = sub.add_parser("node-consumers", help="make the request consumers of these "
                        "machines' `smr up` on a shared NATS, whose own users may create none "
                        "(as the operator: SMR_NATS_USER=smr-admin)")
    nc.add_argument("nodes", nargs="+", metavar="NODE", help="a machine's SMR_NODE_NAME")
    sub.add_parser("watcher", help="watch Kubernetes and publish checkpoint and restore "
                   "requests (needs SMR_NATS_URL)")
    sub.add_parser("agent", help="the node agent: checkpoint and restore this node's pod "
                   "containers (needs SMR_NATS_URL, SMR_NODE_NAME, host PID namespace)")
    sub.add_parser("storage", help="the storage service: answers storage queries, applies "
                   "retention (needs SMR_NATS_URL)")
    sub.add_parser("webhook", help="the mutating admission webhook: opted-in pods get the "
                   "smr RuntimeClass (HTTPS on SMR_WEBHOOK_PORT)")
    sub.add_parser("natsauth", help="NATS auth callout: node agents log in with their "
                   "ServiceAccount token, each held to its node's subjects")
    return p
