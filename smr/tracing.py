"""OpenTelemetry tracing, and the W3C trace context carried in NATS headers.

Tracing is configured by the standard ``OTEL_*`` variables: with
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_TRACES_EXPORTER=otlp``) spans are
exported over OTLP/HTTP; otherwise the API's no-op provider stays in place and
a span costs a function call.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context

tracer = trace.get_tracer("smr")


def setup(service: str) -> None:
    """Install an OTLP exporter when the environment asks for one."""
    wanted = os.environ.get("OTEL_TRACES_EXPORTER", "")
    if wanted == "none" or not (wanted == "otlp" or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                                or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME", f"smr-{service}")
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current trace context (traceparent, tracestate) to headers."""
    propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str] | None) -> Context:
    return propagate.extract(dict(headers or {}))


def traceparent() -> str | None:
    """The current span's W3C traceparent, kept with what a step writes (a
    manifest) so that later work on it (a restore) joins the same trace."""
    return inject({}).get("traceparent")


def continuing(traceparent_: str | None) -> Context | None:
    """The context of a stored traceparent, or None (then the current one applies)."""
    return extract({"traceparent": traceparent_}) if traceparent_ else None
