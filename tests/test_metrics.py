"""The metrics an operator scrapes, after a real checkpoint and restore (CRIU,
nats-server) and a real dead letter, read over HTTP from /metrics and parsed
with prometheus-client's own parser; a real Prometheus (Debian's, from
.tools) scraping them; and `smr status`, which shows the same facts."""

from __future__ import annotations

import asyncio
import shutil
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from smr import metrics
from smr.bus import subject
from smr.contract.messages import CkptRequested, Target
from smr.natsserver import free_port
from tests import nats_auth
from tests.test_local_smr import Harness, running
from tests.test_observability import dashboard_exprs

pytestmark = pytest.mark.criu

TOOLS = Path(__file__).resolve().parents[1] / ".tools" / "bin"


@pytest.fixture
async def h(criu_binary: str, nats_users: nats_auth.SecuredNats, tmp_path: Path, node: str
            ) -> AsyncIterator[Harness]:
    async with running(Harness, criu_binary, nats_users, tmp_path, node, 5.0) as harness:
        yield harness


@pytest.fixture
async def endpoint() -> AsyncIterator[str]:
    runner = await metrics.serve(0, "127.0.0.1")
    yield f"http://127.0.0.1:{metrics.bound_port(runner)}/metrics"
    await runner.cleanup()


async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    # In a thread: the server answers on this test's event loop.
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_move_with_a_checkpoint_a_restore_and_a_dead_letter(
        h: Harness, endpoint: str) -> None:
    before = await scrape(endpoint)
    job = await h.start(64)
    done = await h.checkpoint(job.id)
    assert done.status == "succeeded", done.error
    restored = await h.restore(job.id)
    assert restored.status == "succeeded", restored.error
    await h.bus.publish_raw(subject("ckpt.requested", h.settings.node, "local"), b"not json")
    deadline = time.monotonic() + 10
    while (after := await scrape(endpoint)) and value(
            after, "smr_dead_letters_total", subject="ckpt.requested") == value(
            before, "smr_dead_letters_total", subject="ckpt.requested"):
        assert time.monotonic() < deadline, "the dead letter was not counted"
        await asyncio.sleep(0.1)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("smr_steps_total", kind="checkpoint", reason="api", outcome="succeeded") == 1
    assert delta("smr_steps_total", kind="restore", reason="api", outcome="succeeded") == 1
    assert delta("smr_step_bytes_total", kind="checkpoint") == done.size_bytes
    assert delta("smr_step_bytes_total", kind="restore") == restored.size_bytes
    # The dump's duration landed in the first bucket at or above it, not below.
    dump = done.durations["dump"]
    for le in ("0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0"):
        counted = delta("smr_step_phase_seconds_bucket", kind="checkpoint", phase="dump", le=le)
        assert counted == (1 if float(le) >= dump else 0), (le, dump)
    stamp = value(after, "smr_latest_checkpoint_timestamp_seconds", checkpoint_namespace="local",
                  checkpoint_id=job.id)
    assert time.time() - 60 < stamp <= time.time()
    assert delta("smr_dead_letters_total", subject="ckpt.requested") == 1


@pytest.fixture
def fast_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    from smr.bus import worker

    monkeypatch.setattr(worker, "LAG_EVERY_S", 0.05)


async def test_consumer_lag_shows_requests_waiting_behind_a_running_step(
        fast_lag: None, h: Harness, endpoint: str) -> None:
    job = await h.start(128)
    reqs = [CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=job.id,
                          target=Target.job(job.id), node=h.settings.node, leave_running=True)
            for _ in range(4)]
    for r in reqs:
        await h.bus.publish(r)

    async def finished() -> bool:
        states = [s for s, _ in await asyncio.gather(*(h.bus.step_state(r.request_id)
                                                       for r in reqs))]
        return all(s and s["state"] == "done" for s in states)

    seen = []
    deadline = time.monotonic() + 90
    while not await finished():
        assert time.monotonic() < deadline, f"the checkpoints did not finish: {seen[-5:]}"
        seen.append(value(await scrape(endpoint), "smr_requests_pending", kind="checkpoint"))
        await asyncio.sleep(0.05)
    # One step runs at a time per node: the others waited, and the metric said so.
    assert max(seen) >= 2, seen
    for _ in range(100):
        if value(await scrape(endpoint), "smr_requests_pending", kind="checkpoint") == 0:
            break
        await asyncio.sleep(0.05)
    assert value(await scrape(endpoint), "smr_requests_pending", kind="checkpoint") == 0


async def test_smr_status_shows_checkpoints_running_requests_and_failures(h: Harness) -> None:
    from smrctl import status

    job = await h.start(64)
    done = await h.checkpoint(job.id, leave_running=True)
    assert done.status == "succeeded", done.error
    failed = await h.checkpoint("no-such-job")
    assert failed.status == "failed"
    await h.bus.publish_raw(subject("ckpt.requested", h.settings.node, "local"), b"{not json")
    big = await h.start(384)
    slow = CkptRequested(request_id=uuid.uuid4().hex, checkpoint_id=big.id,
                         target=Target.job(big.id), node=h.settings.node, leave_running=True)
    await h.bus.publish(slow)
    deadline = time.monotonic() + 30
    # (The session's KV holds other tests' requests too: look for this one.)
    while not (running := [r for r in (await status.gather(h.bus))["running"]
                           if r["request_id"] == slow.request_id]):
        assert time.monotonic() < deadline, "the running checkpoint never showed"
    assert running[0]["checkpoint_id"] == big.id and running[0]["kind"] == "checkpoint"
    await h.bus.wait_result(slow.request_id, "ckpt.requested", timeout=120)

    st = await status.gather(h.bus)
    mine = next(c for c in st["checkpoints"] if c["checkpoint_id"] == job.id)
    assert mine["generation"] == done.generation and mine["size_bytes"] == done.size_bytes
    assert mine["namespace"] == "local" and 0 <= mine["age_s"] < 120
    # The newest failures come first; this test's is among them.
    mine_failed = next(f for f in st["failures"] if f["request_id"] == failed.request_id)
    assert mine_failed["checkpoint_id"] == "no-such-job" and mine_failed["kind"] == "checkpoint"
    assert mine_failed["code"] == failed.error["code"]  # type: ignore[index]
    assert st["dead_letters"]["count"] >= 1
    text = status.render(st)
    assert job.id in text and "no-such-job" in text and failed.error["message"] in text  # type: ignore[index]
    # -n: one namespace's checkpoints, running requests and failures only.
    local = await status.gather(h.bus, namespace="local", failures=1000)
    assert failed.request_id in {f["request_id"] for f in local["failures"]}
    other = await status.gather(h.bus, namespace=f"none-{uuid.uuid4().hex[:6]}",
                                failures=1000)
    assert other["checkpoints"] == [] and other["running"] == [] and other["failures"] == [], \
        f"`smr status -n` of a namespace with nothing in it lists: {other}"


@pytest.fixture
def prometheus() -> str:
    binary = shutil.which("prometheus") or str(TOOLS / "prometheus")
    if not Path(binary).exists():
        pytest.skip("no prometheus binary: `make setup` installs it into .tools/bin")
    return binary


async def test_a_real_prometheus_scrapes_smr_and_answers_queries(
        h: Harness, endpoint: str, prometheus: str, tmp_path: Path) -> None:
    port, target = free_port(), endpoint.split("/")[2]
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: smr, static_configs: [{{targets: ['{target}']}}]}}]\n")
    proc = await asyncio.create_subprocess_exec(
        prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
        stdout=asyncio.subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    api = f"http://127.0.0.1:{port}/api/v1/query?query="

    async def query(expr: str) -> list[dict[str, Any]]:
        url = api + urllib.parse.quote(expr)
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        return orjson.loads(body)["data"]["result"]

    try:
        job = await h.start(64)
        done = await h.checkpoint(job.id, leave_running=True)
        assert done.status == "succeeded", done.error
        expr = f'time() - smr_latest_checkpoint_timestamp_seconds{{checkpoint_id="{job.id}"}}'
        deadline = time.monotonic() + 30
        while True:
            try:
                ages = await query(expr)
                bytes_ = await query('smr_step_bytes_total{kind="checkpoint"}')
                if ages and bytes_:
                    break
            except OSError:
                pass  # still starting
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            await asyncio.sleep(0.5)
        assert 0 <= float(ages[0]["value"][1]) < 60
        assert ages[0]["metric"]["checkpoint_namespace"] == "local"
        # What Prometheus stored is what the endpoint served (nothing else runs now).
        served = value(await scrape(endpoint), "smr_step_bytes_total", kind="checkpoint")
        assert float(bytes_[0]["value"][1]) == served >= done.size_bytes  # type: ignore[operator]
        # Every query of the Grafana dashboard evaluates (a bad one is an HTTP
        # 400); those that need no rate window have data already.
        for expr in dashboard_exprs():
            got = await query(expr.replace("$__rate_interval", "1m"))
            if "smr_latest_checkpoint" in expr:
                assert got, expr
    finally:
        proc.terminate()
        await proc.wait()
