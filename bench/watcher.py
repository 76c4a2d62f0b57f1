"""Cordon a node holding 500 opted-in pods; how long until every
ckpt.requested is published and consumed?

The watcher runs against the FAKE Kubernetes API server of the tests (real
kubernetes-asyncio client over HTTP) and a real nats-server. Latency of a
request = from the cordon (the Node update) to the moment a JetStream
consumer holds it. Printed side by side: the baseline (one publish at a time,
each waiting for its ack) and the watcher's pipelined publishing
(SMR_PUBLISH_CONCURRENCY). Target: p99 under 1 s.

    .venv/bin/python bench/watcher.py [--pods 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.kubeapi import api_client
from services.storage.local import LocalBackend
from services.storage.service import StorageService
from services.storage.store import CheckpointStore
from services.watcher.service import Watcher
from smr import config
from smr.bus import STREAM_REQUESTS, Bus, node_token
from smr.natsserver import NatsServer
from tests.fake_apiserver import FakeApiServer, node, pod


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


async def one_round(bus: Bus, settings: config.Settings, pods: int, concurrency: int
                    ) -> list[float]:
    kube = await FakeApiServer().start()
    api = await api_client(kube.url, token=kube.token("smr-watcher"))
    name = f"bench-{uuid.uuid4().hex[:6]}"
    kube.put("nodes", node(name))
    for i in range(pods):
        kube.put("pods", pod(f"p{i}", name, labels={"smr.dev/node-restore": "true"}))
    w = Watcher(bus, api, settings.replace(publish_concurrency=concurrency,
                                           lease_name=f"bench-{name}"),
                durable_prefix=f"bench-{name}")
    task = asyncio.create_task(w.run())
    await asyncio.wait_for(w.ready.wait(), 60)
    arrived: list[float] = []
    done = asyncio.Event()

    async def got(m: object) -> None:
        arrived.append(time.monotonic())
        if len(arrived) == pods:
            done.set()

    sub = await bus.js.subscribe(f"ckpt.requested.{node_token(name)}.*", stream=STREAM_REQUESTS,
                                 ordered_consumer=True, cb=got)
    await asyncio.sleep(0.5)
    n = kube.get("nodes", name)
    assert n is not None
    n["spec"]["unschedulable"] = True
    t0 = time.monotonic()
    kube.put("nodes", n)  # the cordon
    await asyncio.wait_for(done.wait(), 120)
    await sub.unsubscribe()
    w.stop()
    await task
    await api.close()
    await kube.stop()
    return [t - t0 for t in arrived]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    s = config.load({})
    with tempfile.TemporaryDirectory() as d:
        srv = NatsServer(s.nats_server_binary(), Path(d))
        srv.start()
        try:
            bus = await Bus.connect(srv.url, name="bench")
            # Storage answers the watcher's restore queries, as in a cluster.
            storage = StorageService(bus, CheckpointStore(LocalBackend(Path(d) / "store")))
            storage_task = asyncio.create_task(storage.run())
            results: dict[str, list[list[float]]] = {"baseline": [], "pipelined": []}
            for _ in range(a.rounds):
                results["baseline"].append(await one_round(bus, s, a.pods, 1))
                results["pipelined"].append(await one_round(
                    bus, s, a.pods, s.publish_concurrency))
            storage.stop()
            await storage_task
            await bus.close()
        finally:
            srv.stop()
    print(f"cordon of a node with {a.pods} opted-in pods -> every ckpt.requested consumed "
          f"({a.rounds} rounds, median of rounds)")
    print(f"{'':12}{'p50 s':>10}{'p99 s':>10}{'max s':>10}")
    rows = {}
    for label, rounds in results.items():
        p50 = statistics.median(pct(r, 50) for r in rounds)
        p99 = statistics.median(pct(r, 99) for r in rounds)
        mx = statistics.median(max(r) for r in rounds)
        rows[label] = p99
        print(f"{label:12}{p50:10.3f}{p99:10.3f}{mx:10.3f}")
    print(f"pipelined p99 {rows['pipelined']:.3f}s vs target 1.0s: "
          f"{'met' if rows['pipelined'] < 1.0 else 'NOT met'}; baseline/pipelined p99 "
          f"{rows['baseline'] / rows['pipelined']:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
