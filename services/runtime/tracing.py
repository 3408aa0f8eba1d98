"""Traces: a server span per RPC, a client span per downstream call, W3C trace context in
gRPC metadata, and the tracer provider every service process sets up from the spec.

- `configure_tracing(spec, instance)` (the service entry point calls it once) installs an
  SDK tracer provider: parent-based sampling with the spec's ratio for new traces, a batch
  span processor exporting OTLP/gRPC to `tracing.otlp_endpoint`. Without it (tracing off,
  the trace store itself, unit tests) the API's no-op tracer runs, which still passes a
  caller's trace context on unchanged.
- `open_server_span`/`close_server_span` (the server's call path, `call_path.py`, calls
  them around every call) open the server span of a call, child of the caller's
  `traceparent`, and make it current for the handler. A call whose caller's trace is not
  sampled (most of them: Envoy starts every trace) is handed to the handler untouched: no
  span object, no context, nothing downstream records (parent-based sampling), and the
  caller's trace headers go on as they came.
- `traced_call` wraps one downstream call on the request path (the gateway's feature and
  model calls): inside a recorded span it opens a client span and sends its context as
  `traceparent`/`tracestate`; otherwise it sends the trace headers already in the call's
  metadata. `client_interceptors()` do the same for channels off the request path (health
  watches, artifact pulls), where grpc.aio's intercepted-call path costs nothing that
  matters.
- A span that points at others without being their child (a model server's batch serves
  many traces) is linked to them; `LinkAwareSampler` records it whenever one of its links
  is recorded, so a sampled request's batch is never missing from its trace.

Small functions over the SDK rather than `opentelemetry-instrumentation-grpc`: that
package is a beta paired with one SDK release, and its spans cannot carry our attributes
(request id, model, version) or the batch links. Measured (docs/observability.md,
"Traces"): most of the per-call cost was grpc.aio's intercepted-call path, not the spans,
which is why the request path calls without it, servers serve without it (one wrapper per
method, `call_path.py`) and unsampled calls skip the spans.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

from servemesh.contract.wire import TRACE_HEADERS
from servemesh.identity.credentials import client_credentials, server_name_option
from servemesh.identity.enroll import TRACE_STORE_IDENTITY, enrolled
from servemesh.spec import Instance, ResolvedSpec

TRACER_NAME = "servemesh"
# W3C trace context only: the one format Envoy's OpenTelemetry tracer reads and writes.
_PROPAGATOR = TraceContextTextMapPropagator()
# A span an export could not deliver is dropped after this long: a stalled collector must
# not hold a service's memory or its exit.
_EXPORT_TIMEOUT_S = 2.0


T = TypeVar("T")

# A W3C traceparent whose sampled flag is clear: the caller's trace records nothing here.
_UNSAMPLED = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f][02468ace]$")
_TRACEPARENT = TRACE_HEADERS[0]

# Whether this process records spans (an SDK provider is installed; OpenTelemetry takes one
# provider per process, never another). Without one nothing in the process records, so
# every server call takes the untouched path.
_recording = False


def _records() -> bool:
    global _recording
    if not _recording:
        _recording = isinstance(trace.get_tracer_provider(), TracerProvider)
    return _recording


# A proxy: the no-op tracer until a provider is installed, then that provider's tracer
# (looked up once; asking the SDK provider for a tracer per span cost ~100 µs a call).
_TRACER = trace.get_tracer(TRACER_NAME)


def tracer() -> trace.Tracer:
    """The servemesh tracer (the no-op tracer until `configure_tracing` ran)."""
    return _TRACER


# --- sampling ------------------------------------------------------------------------------


class LinkAwareSampler(Sampler):
    """For a new trace: recorded when any linked span is, else `fallback`'s decision."""

    def __init__(self, fallback: Sampler) -> None:
        self.fallback = fallback

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: trace.TraceState | None = None,
    ) -> SamplingResult:
        if links and any(link.context.trace_flags.sampled for link in links):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, trace_state)
        return self.fallback.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"LinkAware{{{self.fallback.get_description()}}}"


def mesh_sampler(ratio: float) -> Sampler:
    """A caller's sampled flag decides (parent-based); a new trace is kept at `ratio`."""
    return ParentBased(root=LinkAwareSampler(TraceIdRatioBased(ratio)))


def configure_tracing(
    spec: ResolvedSpec, instance: str, found: Instance | None = None
) -> TracerProvider | None:
    """Install this process's tracer provider from the spec; None when tracing is off.

    Spans leave in batches at least every `tracing.export_interval_ms`; the provider
    flushes what is left when the process exits.
    """
    settings = spec.tracing
    if not settings.enabled or not settings.otlp_endpoint:
        return None
    found = found or spec.instance(instance)
    resource = Resource.create(
        {
            "service.name": found.service,
            "service.instance.id": instance,
            "service.namespace": spec.name,
            "cloud.availability_zone": found.zone,
        }
    )
    provider = TracerProvider(resource=resource, sampler=mesh_sampler(settings.sample_ratio))
    if spec.embedded_trace_store_port is not None:
        # The mesh's own store: mutual TLS as on every other hop.
        identity = enrolled(spec, instance)
        exporter = OTLPSpanExporter(
            endpoint=settings.otlp_endpoint,
            credentials=client_credentials(identity, instance),
            channel_options=(server_name_option(identity, TRACE_STORE_IDENTITY),),
            timeout=_EXPORT_TIMEOUT_S,
        )
    else:
        # A collector of the operator's choosing, on an address the spec names.
        exporter = OTLPSpanExporter(
            endpoint=settings.otlp_endpoint, insecure=True, timeout=_EXPORT_TIMEOUT_S
        )
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=settings.export_interval_ms)
    )
    trace.set_tracer_provider(provider)
    return provider


# --- propagation ---------------------------------------------------------------------------


def _text(value: str | bytes) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else value


def extract_context(metadata: Sequence[tuple[str, str | bytes]] | None) -> Context:
    """The caller's trace context from gRPC metadata (an empty context when it sent none)."""
    carrier = {key: _text(value) for key, value in metadata or () if key in TRACE_HEADERS}
    return _PROPAGATOR.extract(carrier) if carrier else Context()


def trace_metadata(ctx: Context | None = None) -> list[tuple[str, str]]:
    """`traceparent` (and `tracestate`) naming the current span, or that of `ctx`."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return list(carrier.items())


def span_name(method: str | bytes) -> str:
    """ "/pkg.Service/Method" as a span name: "pkg.Service/Method" (OpenTelemetry's rule)."""
    return _text(method).lstrip("/")


# --- server spans --------------------------------------------------------------------------


def _finish_server_span(
    span: trace.Span, context: grpc.aio.ServicerContext, error: BaseException | None
) -> None:
    if span.is_recording():
        code = context.code()
        if code is None and error is not None:
            # An exception nothing turned into a status: grpc answers UNKNOWN.
            code = grpc.StatusCode.UNKNOWN
        code = code or grpc.StatusCode.OK
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


def _traced_here(metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
    """Whether the caller's trace is sampled or new (a trace without a `traceparent` is
    sampled here at the spec's ratio)."""
    for key, value in metadata or ():
        if key == _TRACEPARENT:
            return _UNSAMPLED.match(_text(value)) is None
    return True


def is_traced(metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
    """Whether a call with `metadata` records spans here: this process records, and the
    caller's trace is sampled or new."""
    return _records() and _traced_here(metadata)


ServerSpan = tuple[trace.Span, object]


def open_server_span(name: str, context: grpc.aio.ServicerContext) -> ServerSpan | None:
    """The server span of a call named `name` ("pkg.Service/Method", see `span_name`),
    child of the caller's trace context and current until `close_server_span`; None when
    the call records nothing here (this process does not record, or the caller's trace is
    not sampled): the handler then runs untouched, and the caller's trace headers go on as
    they came."""
    if not _records():
        return None
    metadata = context.invocation_metadata()
    if not _traced_here(metadata):
        return None
    parent = extract_context(metadata)
    span = tracer().start_span(
        name,
        context=parent,
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.method": name},
    )
    return span, otel_context.attach(trace.set_span_in_context(span, parent))


def close_server_span(
    opened: ServerSpan, context: grpc.aio.ServicerContext, error: BaseException | None
) -> None:
    """End the span with the call's status; `error`: what the call raised, if anything."""
    span, token = opened
    _finish_server_span(span, context, error)
    otel_context.detach(token)  # type: ignore[arg-type]


# --- client spans --------------------------------------------------------------------------


async def traced_call(
    method: str,
    call: Callable[[list[tuple[str, str]]], Awaitable[T]],
    metadata: list[tuple[str, str]],
) -> T:
    """`call(metadata)` with the trace context on it: inside a recorded span, a client span
    of its own (named after `method`, "/pkg.Service/Method") whose context replaces any
    trace headers in `metadata`; inside a span that is not recorded, that span's context;
    outside any span, `metadata` as it is (the caller's own trace headers, passed on)."""
    current = trace.get_current_span()
    if not current.is_recording():
        if not current.get_span_context().is_valid:
            return await call(metadata)
        return await call(_with_trace(metadata, trace_metadata()))
    name = span_name(method)
    span = tracer().start_span(
        name, kind=SpanKind.CLIENT, attributes={"rpc.system": "grpc", "rpc.method": name}
    )
    code: grpc.StatusCode | None = None
    try:
        reply = await call(_with_trace(metadata, trace_metadata(trace.set_span_in_context(span))))
        code = grpc.StatusCode.OK
        return reply
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        raise
    finally:
        _end_client_span(span, code)


def _with_trace(
    metadata: list[tuple[str, str]], headers: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    return [*(item for item in metadata if item[0] not in TRACE_HEADERS), *headers]


def _client_span(details: grpc.aio.ClientCallDetails) -> tuple[trace.Span, Any]:
    """A client span for the call (child of the current span) and the call's details with
    its trace context in the metadata."""
    name = span_name(details.method)
    span = tracer().start_span(
        name, kind=SpanKind.CLIENT, attributes={"rpc.system": "grpc", "rpc.method": name}
    )
    headers = trace_metadata(trace.set_span_in_context(span))
    if not headers:  # no trace context at all: leave the call's metadata as it is
        return span, details
    metadata = grpc.aio.Metadata(
        *[(k, v) for k, v in details.metadata or () if k not in TRACE_HEADERS], *headers
    )
    return span, grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


def _end_client_span(span: trace.Span, code: grpc.StatusCode | None) -> None:
    if span.is_recording():
        code = code or grpc.StatusCode.CANCELLED
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


async def _traced_response_call(span: trace.Span, start: Callable[[], Awaitable[Any]]) -> Any:
    """Start a call with one response; end its span when the call ends."""
    code: grpc.StatusCode | None = None
    try:
        call = await start()
        code = await call.code()
        return call
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        raise
    finally:
        _end_client_span(span, code)


class _UnaryUnaryTracing(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        span, details = _client_span(client_call_details)
        return await _traced_response_call(span, lambda: continuation(details, request))


class _StreamUnaryTracing(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        span, details = _client_span(client_call_details)
        return await _traced_response_call(span, lambda: continuation(details, request_iterator))


# Tasks that end a stream's client span (held until done: the loop keeps weak references).
_finishing: set[asyncio.Future[None]] = set()


class _UnaryStreamTracing(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        span, details = _client_span(client_call_details)
        try:
            call = await continuation(details, request)
        except grpc.aio.AioRpcError as exc:
            _end_client_span(span, exc.code())
            raise

        async def finish(finished: Any) -> None:
            # The call is over: its status is there at once.
            _end_client_span(span, await finished.code())

        def done(finished: Any) -> None:
            task = asyncio.ensure_future(finish(finished))
            _finishing.add(task)
            task.add_done_callback(_finishing.discard)

        call.add_done_callback(done)
        return call


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a channel a service creates: a client span per call, its trace
    context sent on."""
    return [_UnaryUnaryTracing(), _StreamUnaryTracing(), _UnaryStreamTracing()]
