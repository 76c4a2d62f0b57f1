"""Prometheus metrics: what an operator watches and alerts on.

Every step result goes through ``observe_result`` (the bus worker records
every result in one place), every dead letter through ``DEAD_LETTERS``.
Names follow Prometheus conventions: the ``smr_`` prefix, base units,
``_total`` for counters; labels are bounded sets (kind, reason, outcome,
phase, error code, subject kind, and the checkpoint id of each protected
workload), never a request id or a pod uid. ``serve`` exposes them on
SMR_METRICS_PORT.
"""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from smr.contract.messages import CkptDone, RestoreDone

disable_created_metrics()  # no *_created series: Prometheus does not need them
REGISTRY = CollectorRegistry(auto_describe=True)

STEPS = Counter("smr_steps_total", "Checkpoint and restore steps finished, by outcome",
                ["kind", "reason", "outcome"], registry=REGISTRY)
FAILURES = Counter("smr_step_failures_total", "Failed steps, by error code",
                   ["kind", "code"], registry=REGISTRY)
PHASE = Histogram("smr_step_phase_seconds", "Seconds each phase of a step took, by phase: "
                  "pre_dump, dump, rootfs, durable, download, restore, verify, "
                  "verify_after_criu, cuda_lock, coop_pause, time_wait, "
                  "cuda_checkpoint, cuda_restore, cuda_unlock, pid_wait, downtime, total "
                  "(schemas/common.json says what each times)",
                  ["kind", "phase"], registry=REGISTRY,
                  buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
BYTES = Counter("smr_step_bytes_total", "Bytes of checkpoint images written (checkpoint) or "
                "read back (restore), before compression", ["kind"], registry=REGISTRY)
LATEST = Gauge("smr_latest_checkpoint_timestamp_seconds", "When the newest checkpoint of each "
               "workload was committed (Unix time); alert on time() - this",
               ["checkpoint_namespace", "checkpoint_id"], registry=REGISTRY)
DEAD_LETTERS = Counter("smr_dead_letters_total", "Messages dead-lettered, by subject kind",
                       ["subject"], registry=REGISTRY)
PENDING = Gauge("smr_requests_pending", "Requests on this node's subject not yet finished: "
                "waiting for the worker, or taken and not yet acknowledged (consumer lag)",
                ["kind"], registry=REGISTRY)
GPU_STATE_LOST = Counter("smr_gpu_state_lost_total", "Checkpoints that failed after the GPU "
                         "lock whose job's GPU state the driver did not give back (the job "
                         "was ended: error code gpu-state-lost)", registry=REGISTRY)
HEARTBEAT_LATENESS = Histogram("smr_heartbeat_lateness_seconds", "How long after its due time "
                               "a heartbeat checkpoint was requested", registry=REGISTRY,
                               buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600))
HEARTBEATS_MISSED = Counter("smr_heartbeats_missed_total", "Heartbeats skipped because no "
                            "watcher leader ran while they fell due", registry=REGISTRY)
GC_ACTIONS = Counter("smr_storage_gc_actions_total", "What garbage collection and retention "
                     "removed: upload_aborted, generation_removed (no manifest), "
                     "generation_retired (retention)", ["action"], registry=REGISTRY)
STORED_BYTES = Gauge("smr_storage_stored_bytes", "Bytes of committed checkpoint generations "
                     "in storage, as stored (after compression), at the last scan",
                     registry=REGISTRY)
STORED_GENERATIONS = Gauge("smr_storage_generations", "Committed generations in storage at "
                           "the last scan", registry=REGISTRY)

# Labelled by the MutatingWebhookConfiguration probed, so that only a process that
# probed has a series: an unlabelled gauge is 0 in every smr process, and would fire
# the alert everywhere.
WEBHOOK_REACHABLE = Gauge("smr_webhook_reachable", "Whether the API server reached the "
                          "webhook at the last probe (1) or admitted the probe pod unmutated "
                          "(0: opted-in pods start unprotected); the watcher's dry-run probe",
                          ["configuration"], registry=REGISTRY)
WEBHOOK_PROBE_SECONDS = Histogram("smr_webhook_probe_seconds", "How long the watcher's "
                                  "dry-run probe of the webhook took (the API server's "
                                  "admission included)", ["configuration"], registry=REGISTRY,
                                  buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30))
WEBHOOK_PROBED_AT = Gauge("smr_webhook_probe_timestamp_seconds", "When the watcher last "
                          "probed the webhook (Unix time)", ["configuration"],
                          registry=REGISTRY)


def kind_label(step_kind: str) -> str:
    """The ``kind`` label of a step kind (``ckpt.requested`` → ``checkpoint``)."""
    return {"ckpt": "checkpoint", "restore": "restore"}.get(step_kind.split(".")[0], step_kind)


def observe_result(result: CkptDone | RestoreDone) -> None:
    kind = kind_label(result.SCHEMA)
    STEPS.labels(kind, result.reason, result.status).inc()
    if result.status == "failed":
        FAILURES.labels(kind, (result.error or {}).get("code", "unknown")).inc()
        return
    for phase, seconds in result.durations.items():
        PHASE.labels(kind, phase).observe(seconds)
    if result.size_bytes:
        BYTES.labels(kind).inc(result.size_bytes)
    if kind == "checkpoint":
        LATEST.labels(result.target.namespace or "local", result.checkpoint_id).set(time.time())


async def serve(port: int, host: str = "0.0.0.0") -> web.AppRunner:
    """``GET /metrics`` on ``port`` (0: any free one; the runner's site says which)."""
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def bound_port(runner: web.AppRunner) -> int:
    site = next(iter(runner.sites))
    return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
