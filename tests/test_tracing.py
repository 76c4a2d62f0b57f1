"""One trace from publish to the consumer's step, through NATS headers."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from smr import tracing
from smr.bus import Bus
from tests.test_bus import CountingStep, request, run_worker, stop


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


async def test_trace_continues_from_publish_into_the_step(
    spans: InMemorySpanExporter, bus: Bus, node: str
) -> None:
    w, t = await run_worker(bus, CountingStep(), node)
    try:
        with tracing.tracer.start_as_current_span("cordon observed") as root:
            await bus.publish(request(node, "traced-1"))
        await bus.wait_result("traced-1", "ckpt.requested", timeout=10)
    finally:
        await stop(w, t)
    trace_id = root.get_span_context().trace_id
    names = {s.name for s in spans.get_finished_spans() if s.context.trace_id == trace_id}
    assert {"cordon observed", "publish ckpt.requested", "consume ckpt.requested",
            "step ckpt.requested", "publish ckpt.done"} <= names
