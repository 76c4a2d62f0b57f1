"""Traces in tests: one SDK tracer provider for the session, whose span
processors each test adds and removes, and an OTLP/HTTP receiver.

The receiver is a plain HTTP server that accepts what an OpenTelemetry
collector's ``otlphttp`` receiver accepts on ``/v1/traces`` (protobuf
``ExportTraceServiceRequest``, gzip or not) and decodes it with the
OpenTelemetry project's own generated classes (opentelemetry-proto). It
stands in for a collector, which cannot be installed here."""

from __future__ import annotations

import contextlib
import gzip
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.context import Context
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor


class Processors(SpanProcessor):
    """The session provider's one processor: forwards to those a test added."""

    def __init__(self) -> None:
        self.added: list[SpanProcessor] = []

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        for p in list(self.added):
            p.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        for p in list(self.added):
            p.on_end(span)

    def shutdown(self) -> None:
        for p in self.added:
            p.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return all(p.force_flush(timeout_millis) for p in list(self.added))


@dataclass
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    attributes: dict[str, Any]
    events: list[str]
    links: list[str]  # span ids this one links to


@dataclass
class Receiver:
    port: int = 0
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    flush: Callable[[], bool] = lambda: True  # the exporting side's force_flush

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def take(self, body: bytes) -> None:
        req = ExportTraceServiceRequest.FromString(body)
        self.requests += 1
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes
                            if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    self.spans.append(ReceivedSpan(
                        service=service, trace_id=sp.trace_id.hex(), span_id=sp.span_id.hex(),
                        parent_id=sp.parent_span_id.hex(), name=sp.name,
                        attributes={a.key: _value(a.value) for a in sp.attributes},
                        events=[e.name for e in sp.events],
                        links=[ln.span_id.hex() for ln in sp.links]))


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@contextlib.contextmanager
def serve() -> Iterator[Receiver]:
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or \
                    self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_error(415 if self.path == "/v1/traces" else 404)
                return
            try:
                receiver.take(body)
            except Exception as e:  # a body that does not decode is a 400, as a collector says
                self.send_error(400, str(e))
                return
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
