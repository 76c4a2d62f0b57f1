"""One trace from publish to the consumer's step, through NATS headers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from smr import tracing
from smr.bus import Bus
from tests.otlp import Processors, Receiver
from tests.test_bus import CountingStep, request, run_worker, stop


@pytest.fixture
def spans(span_processors: Processors) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    span_processors.added.append(processor)
    yield exporter
    span_processors.added.remove(processor)


async def traced_request(bus: Bus, node: str, rid: str) -> int:
    """A request published under a root span and run by a worker; the trace id."""
    w, t = await run_worker(bus, CountingStep(), node)
    try:
        with tracing.tracer.start_as_current_span("cordon observed") as root:
            await bus.publish(request(node, rid))
        await bus.wait_result(rid, "ckpt.requested", timeout=10)
    finally:
        await stop(w, t)
    return root.get_span_context().trace_id


async def test_trace_continues_from_publish_into_the_step(
    spans: InMemorySpanExporter, bus: Bus, node: str
) -> None:
    trace_id = await traced_request(bus, node, "traced-1")
    names = {s.name for s in spans.get_finished_spans() if s.context.trace_id == trace_id}
    assert {"cordon observed", "publish ckpt.requested", "consume ckpt.requested",
            "step ckpt.requested", "publish ckpt.done"} <= names


async def test_spans_reach_an_otlp_http_receiver_as_one_trace(
    otlp: Receiver, bus: Bus, node: str
) -> None:
    trace_id = await traced_request(bus, node, "traced-otlp")
    assert await asyncio.to_thread(otlp.flush)
    got = otlp.trace(format(trace_id, "032x"))
    by_id = {s.span_id: s for s in got}
    step = next(s for s in got if s.name == "step ckpt.requested")
    assert step.attributes["smr.request_id"] == "traced-otlp"
    assert step.attributes["smr.outcome"] == "succeeded"
    # Every span hangs off another of the same trace, up to the root.
    chain, s = [], step
    while s.parent_id:
        chain.append(s.name)
        s = by_id[s.parent_id]
    assert s.name == "cordon observed"
    assert chain == ["step ckpt.requested", "consume ckpt.requested", "publish ckpt.requested"]
