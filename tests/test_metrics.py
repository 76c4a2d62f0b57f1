"""The metrics an operator scrapes, after a real checkpoint and restore (CRIU,
nats-server) and a real dead letter, read over HTTP from /metrics and parsed
with prometheus-client's own parser."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from smr import metrics
from smr.bus import subject
from smr.natsserver import NatsServer
from tests.test_local_smr import Harness, running

pytestmark = pytest.mark.criu


@pytest.fixture
async def h(criu_binary: str, nats_server: NatsServer, tmp_path: Path, node: str
            ) -> AsyncIterator[Harness]:
    async with running(Harness, criu_binary, nats_server, tmp_path, node, 5.0) as harness:
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
    await h.bus.publish_raw(subject("ckpt.requested", h.settings.node), b"not json")
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
    stamp = value(after, "smr_latest_checkpoint_timestamp_seconds", namespace="local",
                  checkpoint_id=job.id)
    assert time.time() - 60 < stamp <= time.time()
    assert delta("smr_dead_letters_total", subject="ckpt.requested") == 1
