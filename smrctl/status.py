"""`smr status`: for a person at a terminal, the facts the metrics carry.

- protected workloads: each stored checkpoint's latest generation, its age
  and size (from the storage service, ``storage.checkpoints``);
- running requests: their phase and progress (the step-state KV, which the
  workers update at each keepalive);
- the last failures with their reasons (failed steps, and dead letters);
- whether the API server reaches the webhook, and when that was last
  probed (the watcher's dry-run probe, KV bucket ``smr-health``).

Works against `smr up` and a cluster alike: everything comes over the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime
from typing import Any

import nats
import orjson
from nats.js.errors import NotFoundError

from smr.bus import KV_HEALTH, KV_STEPS, QUERY_CHECKPOINTS, STREAM_DLQ, Bus, kind_of, node_token
from smr.contract.errors import SmrError
from smr.contract.messages import StorageQuery, Target, epoch
from smr.metrics import kind_label

log = logging.getLogger(__name__)

FAILURES_SHOWN = 5
# The step-state read: what it still awaits is listed again this often, and it
# shows what came after this long (a bucket of a cluster's week is read in seconds).
RELIST_S = 1.0
STEP_READ_S = 60.0
HEALTH_READ_S = 5.0  # a user that may not read smr-health gets no answer, only a timeout


async def gather(bus: Bus, *, namespace: str | None = None, failures: int = FAILURES_SHOWN
                 ) -> dict[str, Any]:
    """Everything `smr status` shows, as data (``smr status --json`` prints it)."""
    now = time.time()
    reply = await bus.query(QUERY_CHECKPOINTS, StorageQuery(namespace=namespace), timeout=30)
    if reply.error:
        raise SmrError(f"the storage service could not list checkpoints: "
                       f"{reply.error.get('message')}", code="storage-error",
                       hint=reply.error.get("hint", ""))
    checkpoints = [{**g, "age_s": now - epoch(g["created_at"])} for g in reply.generations]
    states = {rid: st for rid, st in (await step_states(bus)).items()
              if namespace is None or _acts_in(st, namespace)}
    running = sorted(
        ({"request_id": rid, "kind": kind_label(kind_of(st.get("subject", ""))),
          "checkpoint_id": st.get("checkpoint_id"), "phase": st.get("phase"),
          "done_bytes": st.get("done_bytes"), "total_bytes": st.get("total_bytes"),
          "owner": st.get("owner"), "silent_s": now - st.get("heartbeat", now)}
         for rid, st in states.items() if st.get("state") == "running"),
        key=lambda r: r["request_id"])
    failed = sorted(
        ({"request_id": rid, "kind": kind_label(st.get("kind", "?")),
          "checkpoint_id": r.get("checkpoint_id"), "finished": st.get("finished", 0),
          "reason": r.get("reason"), "code": (r.get("error") or {}).get("code"),
          "message": (r.get("error") or {}).get("message"), "hint": (r.get("error") or {}).get(
              "hint")}
         for rid, st in states.items() if st.get("state") == "failed"
         for r in [st.get("result") or {}]),
        key=lambda f: -f["finished"])[:failures]
    return {"checkpoints": checkpoints, "running": running, "failures": failed,
            "dead_letters": await dead_letters(bus, failures),
            "webhook": await webhook_probe(bus)}


def _acts_in(state: dict[str, Any], namespace: str) -> bool:
    """Does the step act in ``namespace``? Its result's target says (``local``
    for a job); while it runs, the last token of its request's subject."""
    if target := (state.get("result") or {}).get("target"):
        return bool(Target.from_dict(target).namespace_name == namespace)
    subj = str(state.get("subject") or "")
    return subj.rsplit(".", 1)[-1] == node_token(namespace)


async def webhook_probe(bus: Bus) -> dict[str, Any] | None:
    """The watcher's last probe of the webhook (services/watcher/webhook_probe),
    None where none was recorded (`smr up`: no webhook), or what kept it from
    being read. Read with one message get: the CLI binds no bucket its node's
    user may not read."""
    try:
        m = await asyncio.wait_for(bus.js.get_last_msg(
            f"KV_{KV_HEALTH}", f"$KV.{KV_HEALTH}.webhook"), HEALTH_READ_S)
    except NotFoundError:
        return None
    except (TimeoutError, nats.errors.Error) as e:
        return {"error": f"cannot read the bucket {KV_HEALTH}: {type(e).__name__} {e}"}
    return orjson.loads(m.data or b"{}")  # type: ignore[no-any-return]


async def step_states(bus: Bus) -> dict[str, dict[str, Any]]:
    """The latest state of every request the step-state KV remembers.

    Read until every key the bucket held when asked has come: a watch sends
    the newest message of each key, and a key written meanwhile (a running
    step's keepalive) comes again after. A listed key that expires (the
    bucket's TTL) before it comes sends nothing, so what is still awaited is
    listed again every second and what is gone is awaited no more; keepalives
    never leave the watch quiet long enough for a timeout to end it. nats.py's
    own end-of-values marker is not used: it can come before values the server
    has sent (nats.py issues 842 and 995), and `smr status` then showed no
    step at all, about once in a hundred reads of a small bucket here, and
    left out a running step."""
    missing = set(await bus.kv_keys(KV_STEPS))
    out: dict[str, dict[str, Any]] = {}
    if not missing:
        return out
    # Deletes too: a key's last message may be its tombstone.
    watcher = await bus.kv(KV_STEPS).watchall()
    deadline = time.monotonic() + STEP_READ_S
    listed = time.monotonic()
    try:
        while missing:
            with contextlib.suppress(nats.errors.TimeoutError):
                if entry := await watcher.updates(timeout=RELIST_S):
                    if entry.value:
                        out[entry.key] = orjson.loads(entry.value)
                    else:
                        out.pop(entry.key, None)
                    missing.discard(entry.key)
            if missing and time.monotonic() - listed >= RELIST_S:
                missing &= set(await bus.kv_keys(KV_STEPS))
                listed = time.monotonic()
                if time.monotonic() > deadline:
                    log.warning("the step states of %d requests did not come in %.0f s; "
                                "showing the others", len(missing), STEP_READ_S)
                    break
    finally:
        await watcher.stop()
    return out


async def dead_letters(bus: Bus, n: int) -> dict[str, Any]:
    """How many dead letters are kept, and the last ``n``."""
    try:
        info = await bus.js.stream_info(STREAM_DLQ)
    except NotFoundError:
        return {"count": 0, "last": []}
    last: list[dict[str, Any]] = []
    for seq in range(info.state.last_seq, max(info.state.first_seq, 1) - 1, -1):
        if len(last) == n:
            break
        try:
            m = await bus.js.get_msg(STREAM_DLQ, seq)
        except NotFoundError:
            continue  # removed by the stream's limits
        letter = orjson.loads(m.data or b"{}")
        error = letter.get("error") or {}
        last.append({"subject": letter.get("subject"), "service": letter.get("service"),
                     "code": error.get("code"), "message": error.get("message")})
    return {"count": info.state.messages, "last": last}


def render(st: dict[str, Any]) -> str:
    lines = [f"CHECKPOINTS ({len(st['checkpoints'])})"]
    if st["checkpoints"]:
        lines.append(f"  {'NAMESPACE':<14} {'CHECKPOINT':<24} {'GEN':>4} {'KEPT':>4} "
                     f"{'SIZE':>10} {'AGE':>8}  {'REASON':<12} NODE")
        for c in sorted(st["checkpoints"], key=lambda c: (c["namespace"], c["checkpoint_id"])):
            lines.append(f"  {c['namespace']:<14} {c['checkpoint_id']:<24} {c['generation']:>4} "
                         f"{c.get('stored_generations', 1):>4} {fmt_bytes(c['size_bytes']):>10} "
                         f"{fmt_age(c['age_s']):>8}  {c.get('reason', '-'):<12} {c['node']}")
    lines.append(f"RUNNING ({len(st['running'])})")
    for r in st["running"]:
        amount = fmt_bytes(r["done_bytes"]) if r["done_bytes"] else ""
        if r["total_bytes"]:
            amount += f" / {fmt_bytes(r['total_bytes'])}"
        lines.append(f"  {r['kind']:<18} {r['checkpoint_id'] or '?':<24} {r['phase'] or '?':<16} "
                     f"{amount:<22} {r['request_id']}"
                     + (f"  (silent {r['silent_s']:.0f}s)" if r["silent_s"] > 30 else ""))
    lines.append(f"RECENT FAILURES ({len(st['failures'])})")
    for f in st["failures"]:
        when = datetime.fromtimestamp(f["finished"]).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"  {when}  {f['kind']:<10} {f['checkpoint_id'] or '?':<24} "
                     f"{f['code']}: {f['message']}")
        if f.get("hint"):
            lines.append(f"      hint: {f['hint']}")
    dl = st["dead_letters"]
    lines.append(f"DEAD LETTERS ({dl['count']} kept)")
    for d in dl["last"]:
        lines.append(f"  {d['subject']}: {d['code']}: {(d['message'] or '')[:100]}")
    lines += render_webhook(st.get("webhook"))
    return "\n".join(lines)


def render_webhook(probe: dict[str, Any] | None, now: float | None = None) -> list[str]:
    if probe is None:
        return ["WEBHOOK no probe recorded (`smr up` has no webhook; on a cluster the "
                "smr-watcher Deployment probes it every minute: check that it runs)"]
    if "error" in probe:
        return [f"WEBHOOK unknown: {probe['error']}"]
    at = datetime.fromtimestamp(probe["at"], UTC)
    age = fmt_age((time.time() if now is None else now) - probe["at"])
    state = "reachable" if probe["reachable"] else "UNREACHABLE"
    return [f"WEBHOOK {state} (last probe {at:%Y-%m-%d %H:%M:%S} UTC, {age} ago, "
            f"{probe['seconds']:.2f}s, by {probe.get('by') or '?'})",
            f"  {probe['message']}"]


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{max(0, seconds):.0f}s"
