"""The OTLP receiver without a mesh: the SDK's own OTLP/gRPC exporter sends real spans to it
on loopback, and they land in the store with their parents, links and attributes; spans it
cannot read are counted, never stored."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanKind

from servemesh.contract.wire import Span as SpanAttr
from servemesh.identity import OPERATOR_IDENTITY, TRACE_STORE_IDENTITY, dial_address
from servemesh.identity.credentials import client_credentials, server_name_option
from servemesh.identity.enroll import enrolled
from servemesh.services.runtime import ServiceServer
from servemesh.spec import MeshSpec, Ports, ResolvedSpec, resolve
from servemesh.tracestore.receiver import build_server, store_path
from servemesh.tracestore.store import TraceStore


@pytest.fixture
async def receiver(tmp_path: Path) -> AsyncIterator[tuple[ResolvedSpec, Path]]:
    spec = resolve(MeshSpec(ports=Ports.free(), state_dir=str(tmp_path)))
    server: ServiceServer = await build_server(spec)
    await server.start()
    try:
        yield spec, store_path(tmp_path)
    finally:
        await server.drain()


def _exporter(spec: ResolvedSpec) -> OTLPSpanExporter:
    """An OTLP exporter as a service's: mutual TLS, checking the store's name."""
    identity = enrolled(spec, OPERATOR_IDENTITY)
    return OTLPSpanExporter(
        spec.tracing.otlp_endpoint,
        credentials=client_credentials(identity, OPERATOR_IDENTITY),
        channel_options=(server_name_option(identity, TRACE_STORE_IDENTITY),),
    )


async def test_exported_spans_land_with_parents_links_and_attributes(
    receiver: tuple[ResolvedSpec, Path],
) -> None:
    spec, db = receiver
    provider = TracerProvider(
        resource=Resource.create({"service.name": "gateway", "service.instance.id": "gw-0"})
    )
    provider.add_span_processor(SimpleSpanProcessor(_exporter(spec)))
    tracer = provider.get_tracer("test")

    def record() -> tuple[str, str]:
        with tracer.start_as_current_span("Predict", kind=SpanKind.SERVER) as root:
            root.set_attribute(SpanAttr.REQUEST_ID, "req-1")
            root.set_attribute(SpanAttr.MODEL, "fraud")
            with tracer.start_as_current_span("ModelInfer", kind=SpanKind.CLIENT) as child:
                request = child.get_span_context()
        batch = tracer.start_span("batch", context=None, links=[Link(request)])
        batch.end()
        return f"{root.get_span_context().trace_id:032x}", f"{request.span_id:016x}"

    # The exporter is synchronous: off the loop the receiver answers on.
    trace_id, request_span = await asyncio.to_thread(record)
    provider.shutdown()
    store = TraceStore(db)
    try:
        assert store.find("req-1") == trace_id
        spans = {s.name: s for s in store.trace(trace_id)}
        assert set(spans) == {"Predict", "ModelInfer", "batch"}
        assert spans["ModelInfer"].parent_id == spans["Predict"].span_id
        assert spans["Predict"].service == "gateway" and spans["Predict"].instance == "gw-0"
        assert spans["Predict"].model == "fraud" and spans["Predict"].kind == 2
        assert spans["batch"].links == ((trace_id, request_span),)
        assert spans["batch"].trace_id != trace_id  # its own trace, linked in
    finally:
        store.close()


async def test_unreadable_spans_are_counted_and_not_stored(
    receiver: tuple[ResolvedSpec, Path],
) -> None:
    spec, db = receiver
    endpoint = spec.tracing.otlp_endpoint or ""
    good = trace_pb2.Span(
        trace_id=bytes(range(16)), span_id=bytes(range(8)), name="ok", start_time_unix_nano=1
    )
    bad = [
        trace_pb2.Span(trace_id=b"short", span_id=bytes(8), name="bad ids"),
        trace_pb2.Span(trace_id=bytes(range(1, 17)), span_id=bytes(range(1, 9)), name=""),
    ]
    request = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=[good, *bad])])
        ]
    )
    async with dial_address(spec, endpoint, TRACE_STORE_IDENTITY).aio_channel() as channel:
        answer = await trace_service_pb2_grpc.TraceServiceStub(channel).Export(request, timeout=5)
        assert answer.partial_success.rejected_spans == 2
        # A body that is not an export request at all: INVALID_ARGUMENT, and still serving.
        raw = channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await raw(b"\xff\xff\xff", timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    store = TraceStore(db)
    try:
        assert store.count() == 1
        assert store.find(bytes(range(16)).hex()) is not None
    finally:
        store.close()


def test_the_no_op_tracer_passes_a_callers_trace_context_on() -> None:
    """Tracing off (no provider): a service still hands its caller's context downstream."""
    from servemesh.services.runtime.tracing import extract_context, trace_metadata, tracer

    parent = extract_context([("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")])
    span = tracer().start_span("call", context=parent)
    assert not span.is_recording()
    headers = dict(trace_metadata(trace.set_span_in_context(span)))
    assert headers["traceparent"] == "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
