"""The message fuzzer: hostile messages on every subject a running embedded
node consumes (its checkpointer, restorer and storage service) and on the
storage queries, generated from the JSON Schemas (hypothesis-jsonschema) and
then broken: random bytes, other JSON, truncated JSON, wrong types, hostile
ids (path-like, absolute, NUL, unicode, 1 MB, empty), 200-deep nesting,
out-of-range numbers, missing and unexpected fields, a node name that shares
the node's subject token, request ids reused for other requests.

Each message is published on its own and must be answered: an invalid one by
a dead letter naming why (and, for a query, an error reply), a valid one by
its result. Afterwards the node still serves, a job that ran all along was not
touched, and nothing was written outside the data directory.

`make test` runs SMR_FUZZ_EXAMPLES (default 40) per subject; the full run is
`SMR_FUZZ_EXAMPLES=1000 .venv/bin/python -m pytest tests/test_fuzz.py -s`,
and SMR_FUZZ_SEED replays one."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from smr import metrics
from smr.bus import (
    QUERY_CHECKPOINTS,
    QUERY_GENERATIONS,
    QUERY_LATEST,
    message_subject,
    query_subject,
    subject,
)
from smr.contract import schemas as contract
from smr.contract.errors import ContractError
from smr.contract.messages import CkptRequested, RestoreRequested, Target
from smrctl import demo_counter as counter
from tests import nats_auth
from tests.test_local_smr import Harness, running

pytestmark = pytest.mark.criu

EXAMPLES = int(os.environ.get("SMR_FUZZ_EXAMPLES", "40"))
SEED = int(os.environ.get("SMR_FUZZ_SEED", "20261123"))
ANSWER_S = 15.0

HOSTILE_IDS = [
    "../../etc/passwd", "/etc/passwd", "..", ".", "a/../../b", "a/b", "a\x00b", "\x00",
    "名前", "😀" * 40, "a" * 1_000_000, "", " ", "a\nb", "CON", "%2e%2e%2f", "a" * 300,
    "\udc80", "-leading-dash", "local/../x",
]
ID_PATHS = [("request_id",), ("checkpoint_id",), ("node",), ("namespace",),
            ("target", "job_id"), ("target", "namespace"), ("target", "pod"),
            ("target", "container")]
NUMBERS = [-1, 0, 2**63, 2**70, -(2**70), 1e308, float("nan"), float("inf"), 1.5, True]


# -- generating from the schemas --------------------------------------------------

def bundled(name: str) -> dict[str, Any]:
    """Schema ``name`` with every $ref inlined (hypothesis-jsonschema resolves
    only references inside one document)."""
    docs = {p.name: json.loads(p.read_text()) for p in contract.schema_dir().glob("*.json")}

    def inline(node: Any, doc: str) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                file, _, pointer = node["$ref"].partition("#")
                file = file or doc
                target: Any = docs[file]
                for part in pointer.strip("/").split("/"):
                    target = target[part]
                rest = {k: v for k, v in node.items() if k not in ("$ref", "description")}
                return {**inline(copy.deepcopy(target), file), **inline(rest, doc)}
            return {k: inline(v, doc) for k, v in node.items()
                    if k not in ("$schema", "$id", "$defs", "description", "title")}
        if isinstance(node, list):
            return [inline(v, doc) for v in node]
        return node

    return inline(docs[f"{name}.json"], f"{name}.json")


def dumps(doc: Any) -> bytes:
    # The standard library's encoder: it writes NaN, lone surrogates and deep
    # nesting that a careful encoder would refuse, as a hostile client would.
    return json.dumps(doc).encode()


def put(doc: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    here = out
    for key in path[:-1]:
        if not isinstance(here.get(key), dict):
            here[key] = {}
        here = here[key]
    here[path[-1]] = value
    return out


def nested(depth: int) -> Any:
    value: Any = "bottom"
    for i in range(depth):
        value = [value] if i % 2 else {"x": value}
    return value


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


def hostile(valid: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[tuple[str, bytes]]:
    """(what, payload): valid documents, and the ways to break them."""

    def keyed(f: Callable[[dict[str, Any], str], st.SearchStrategy[bytes]]
              ) -> Callable[[dict[str, Any]], st.SearchStrategy[bytes]]:
        return lambda d: st.sampled_from(sorted(d)).flatmap(lambda k: f(d, k))

    return st.one_of(
        valid.map(lambda d: ("valid", dumps(d))),
        st.binary(max_size=300).map(lambda b: ("random bytes", b)),
        json_values.map(lambda v: ("other JSON", dumps(v))),
        valid.flatmap(lambda d: st.integers(0, len(dumps(d)) - 1).map(
            lambda i: ("truncated", dumps(d)[:i]))),
        valid.flatmap(keyed(lambda d, k: json_values.map(
            lambda v: dumps({**d, k: v})))).map(lambda b: ("wrong type", b)),
        valid.flatmap(lambda d: st.tuples(st.sampled_from(ID_PATHS),
                                          st.sampled_from(HOSTILE_IDS)).map(
            lambda pv: ("hostile id", dumps(put(d, *pv))))),
        valid.flatmap(keyed(lambda d, k: st.just(dumps({x: y for x, y in d.items()
                                                         if x != k})))).map(
            lambda b: ("missing field", b)),
        valid.map(lambda d: ("unexpected field", dumps({**d, "surprise": 1}))),
        valid.flatmap(keyed(lambda d, k: st.just(dumps({**d, k: nested(200)})))).map(
            lambda b: ("200-deep", b)),
        valid.flatmap(lambda d: st.tuples(
            st.sampled_from(["generation", "schema_version", "size_bytes"]),
            st.sampled_from(NUMBERS)).map(lambda kv: ("out of range",
                                                      dumps({**d, kv[0]: kv[1]})))),
    )


def cases(schema: str, fix: Callable[[dict[str, Any]], dict[str, Any]]) -> list[tuple[str, bytes]]:
    """EXAMPLES hostile (and some valid) payloads for ``schema``, reproducibly."""
    out: list[tuple[str, bytes]] = []

    @seed(SEED)
    @settings(max_examples=EXAMPLES, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(hostile(from_schema(bundled(schema)).map(fix)))
    def collect(case: tuple[str, bytes]) -> None:
        out.append(case)

    collect()
    return out


# -- the node under fire ----------------------------------------------------------

@dataclass
class Answer:
    kind: str  # "dead letter", "result", "reply"
    body: dict[str, Any]


class Watch:
    """Dead letters and results as they are published (core NATS taps)."""

    def __init__(self) -> None:
        self.letters: list[tuple[str, dict[str, Any]]] = []
        self.results: dict[str, dict[str, Any]] = {}
        self.changed = asyncio.Event()

    async def start(self, h: Harness) -> None:
        async def letter(m: Any) -> None:
            self.letters.append((m.subject, orjson.loads(m.data)))
            self.changed.set()

        async def result(m: Any) -> None:
            doc = orjson.loads(m.data)
            self.results[doc.get("request_id", "?")] = doc
            self.changed.set()

        self.subs = [await h.bus.nc.subscribe("dlq.>", cb=letter),
                     await h.bus.nc.subscribe("ckpt.done.>", cb=result),
                     await h.bus.nc.subscribe("restore.done.>", cb=result)]

    async def until(self, pred: Callable[[], Answer | None]) -> Answer | None:
        deadline = time.monotonic() + ANSWER_S
        while (got := pred()) is None and time.monotonic() < deadline:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), 0.5)
            except TimeoutError:
                pass
        return got


def _namespace(payload: bytes) -> str | None:
    """The namespace a (maybe malformed) query names, if any."""
    try:
        ns = orjson.loads(payload).get("namespace")
    except Exception:
        return None
    return ns if isinstance(ns, str) and ns else None


@pytest.fixture
async def h(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path
            ) -> AsyncIterator[Harness]:
    # A node name with a dot: its subject token ("fuzz_...") is shared by another
    # valid name, which must not pass for it. The node logs in as its own user;
    # the fuzzer, publishing on every subject, as smr-admin.
    node = f"fuzz.{uuid.uuid4().hex[:8]}"
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0) as harness:
        yield harness


def verdict(schema: str, payload: bytes, node: str) -> str | None:
    """None if the payload is a valid message for this node, else why not."""
    try:
        doc = orjson.loads(payload)
        contract.validate(schema, doc)
    except (orjson.JSONDecodeError, ContractError) as e:
        return str(e)[:80]
    if isinstance(doc, dict) and "node" in doc and doc["node"] != node:
        return "wrong node"
    return None


async def test_hostile_messages_are_answered_and_harm_nothing(h: Harness, tmp_path: Path
                                                              ) -> None:
    node = h.settings.node
    victim = await h.start(32, job_id="fuzz-victim")
    victim_record = (await h.jobs.get(victim.id))[0]
    outside_before = sorted(p.name for p in tmp_path.iterdir())
    repo = Path(__file__).resolve().parents[1]
    repo_before = sorted(p.name for p in repo.iterdir())
    dead_before = {k: metrics.REGISTRY.get_sample_value("smr_dead_letters_total",
                                                        {"subject": k}) or 0
                   for k in ("ckpt.requested", "restore.requested", "ckpt.done")}
    watch = Watch()
    await watch.start(h)
    twin = node.replace(".", "_")  # another valid node name, the same subject token

    def for_node(d: dict[str, Any]) -> dict[str, Any]:
        return {**d, "node": node}

    plan: list[tuple[str, str, str, bytes]] = []  # (subject, schema, what, payload)
    for kind in ("ckpt.requested", "restore.requested"):
        subj = subject(kind, node, "local")
        plan += [(subj, kind, what, p) for what, p in cases(kind, for_node)]
        plan.append((subj, kind, "token twin", dumps({**orjson.loads(
            CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id="ghost",
                          target=Target.job("ghost"), node=twin).to_payload()
            if kind == "ckpt.requested" else RestoreRequested(
                request_id=uuid.uuid4().hex, checkpoint_id="ghost",
                target=Target.job("ghost"), node=twin).to_payload())})))
    plan += [(subject("ckpt.done", node, "local"), "ckpt.done", what, p)
             for what, p in cases("ckpt.done", for_node)]
    for q in (QUERY_LATEST, QUERY_GENERATIONS, QUERY_CHECKPOINTS):
        # Each on its namespace's subject (storage.latest.<ns>), as a client asks.
        plan += [(query_subject(q, _namespace(p)), "storage.query", what, p)
                 for what, p in cases("storage.query", dict)]

    unanswered: list[tuple[str, str, bytes]] = []
    wrong: list[tuple[str, str, str]] = []
    tally: Counter[tuple[str, str]] = Counter()
    queries = 0
    started = time.monotonic()
    for subj, schema, what, payload in plan:
        why = verdict(schema, payload, node)
        tally[subj.split(".")[0] + "." + subj.split(".")[1], what] += 1
        seen = len(watch.letters)
        if schema == "storage.query":
            queries += 1
            reply = orjson.loads((await h.bus.nc.request(subj, payload, timeout=ANSWER_S)).data)
            contract.validate("storage.reply", reply)
            if why and "error" not in reply:
                wrong.append((subj, what, "an invalid query got no error"))
            # (A valid query without the checkpoint_id storage.latest needs is refused too.)
            refused = why or reply.get("error", {}).get("code") == "invalid-message"
            if refused and not await watch.until(lambda s=seen: Answer("dead letter", {})
                                             if len(watch.letters) > s else None):
                unanswered.append((subj, what, payload[:200]))
            continue
        await h.bus.publish_raw(subj, payload)
        if schema == "ckpt.done":
            if why and not await watch.until(lambda s=seen: Answer("dead letter", {})
                                             if len(watch.letters) > s else None):
                unanswered.append((subj, what, payload[:200]))
            continue
        rid = orjson.loads(payload)["request_id"] if why is None else None

        def answered(s: int = seen, rid: str | None = rid) -> Answer | None:
            if len(watch.letters) > s:
                return Answer("dead letter", watch.letters[-1][1])
            if rid and rid in watch.results:
                return Answer("result", watch.results[rid])
            return None

        got = await watch.until(answered)
        if got is None:
            unanswered.append((subj, what, payload[:200]))
        elif why and got.kind != "dead letter":
            wrong.append((subj, what, f"invalid ({why}) but got a result"))
        elif got.kind == "dead letter" and not got.body["error"].get("message"):
            wrong.append((subj, what, "a dead letter without a reason"))
    took = time.monotonic() - started

    # Request ids reused for another request: a dead letter, never the first's result.
    rid = uuid.uuid4().hex
    first = await h.bus.request(CkptRequested(request_id=rid, checkpoint_id="ghost-1",
                                              target=Target.job("ghost-1"), node=node),
                                timeout=ANSWER_S)
    assert first.status == "failed"
    for again in (CkptRequested(request_id=rid, checkpoint_id="ghost-2",
                                target=Target.job("ghost-2"), node=node),
                  RestoreRequested(request_id=rid, checkpoint_id="ghost-1",
                                   target=Target.job("ghost-1"), node=node)):
        seen = len(watch.letters)
        await h.bus.publish_raw(message_subject(again), again.to_payload())
        got = await watch.until(lambda s=seen: Answer("dead letter", watch.letters[-1][1])
                                if len(watch.letters) > s else None)
        assert got and got.body["error"]["code"] == "request-id-reused", got

    print(f"\nfuzz: {len(plan)} messages in {took:.1f}s "
          f"({1000 * took / len(plan):.1f} ms each, seed {SEED}, {EXAMPLES} per subject)")
    print(f"  answered: {len(watch.letters)} dead letters, {len(watch.results)} results, "
          f"{queries} query replies; unanswered {len(unanswered)}, wrongly answered "
          f"{len(wrong)}")
    for (subj, what), n in sorted(tally.items()):
        print(f"  {subj:<22} {what:<18} {n:>5}")
    assert unanswered == [], unanswered[:5]
    assert wrong == [], wrong[:5]
    assert all(len(orjson.dumps(letter)) <= h.bus.nc.max_payload for _, letter in watch.letters)
    for k, before in dead_before.items():
        counted = metrics.REGISTRY.get_sample_value("smr_dead_letters_total", {"subject": k})
        assert counted - before == sum(1 for s, _ in watch.letters
                                       if s.startswith(f"dlq.{k}.")), k

    # The node still serves; the job that ran all along was not touched.
    assert all(not t.done() for t in h.node.tasks), "a worker of the node died"
    assert (await h.jobs.get(victim.id))[0] == victim_record
    done = await h.checkpoint(victim.id)
    assert done.status == "succeeded", done.error
    frozen = int(h.lines(victim)[-1]["step"])
    restored = await h.restore(victim.id)
    assert restored.status == "succeeded", restored.error
    await h.wait_step(victim, frozen + 2)
    after = [ln for ln in h.lines(victim) if int(ln["step"]) > frozen]
    shown = counter.resumed_digest(after)
    assert shown, f"no digest in the first two steps after the restore: {after[:2]}"
    assert shown["digest"] == counter.expected_digest(32, int(shown["step"]))
    # Nothing was written outside the data directory: not beside it, not in the
    # repository, not under the checkpoint store's own namespaces.
    assert sorted(p.name for p in tmp_path.iterdir()) == outside_before
    assert sorted(p.name for p in repo.iterdir()) == repo_before
    store = Path(h.settings.storage_root)
    assert sorted(p.name for p in store.iterdir()) == ["local"]
    assert sorted(p.name for p in (store / "local").iterdir()) == [victim.id]
