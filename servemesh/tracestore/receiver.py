"""The embedded OTLP receiver: `TraceService/Export` over gRPC, spans into the trace store.

Services and Envoy export here when the spec names no collector of its own
(`tracing.otlp_endpoint: null`); `servemesh up` runs it as a supervised process
(`python -m servemesh.tracestore --spec RESOLVED`), on the shared service runtime (health,
reflection, drain on SIGTERM). A span it cannot read (ids of the wrong length, no name) is
counted in the answer's partial success, never stored; the rest of the request is.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from servemesh.contract.wire import Span as SpanAttr
from servemesh.identity import TRACE_STORE_IDENTITY, serving_credentials
from servemesh.services.runtime import ServiceServer, configure_logging, run_service
from servemesh.spec import ResolvedSpec, load_resolved
from servemesh.tracestore.store import SpanRecord, TraceStore

log = logging.getLogger(__name__)

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
# How often retention runs while the receiver is up.
PRUNE_INTERVAL_S = 30.0
_STATUS = {
    trace_pb2.Status.STATUS_CODE_UNSET: "unset",
    trace_pb2.Status.STATUS_CODE_OK: "ok",
    trace_pb2.Status.STATUS_CODE_ERROR: "error",
}


def store_path(state_dir: str | Path) -> Path:
    """Where a mesh's spans live."""
    return Path(state_dir) / "traces" / "traces.db"


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


def _attributes(pairs: Iterable[common_pb2.KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> tuple[list[SpanRecord], int]:
    """The readable spans of an export request, and how many were not."""
    found: list[SpanRecord] = []
    rejected = 0
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        service = str(resource.get("service.name") or "unknown")
        instance = resource.get("service.instance.id")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                if len(span.trace_id) != 16 or len(span.span_id) != 8 or not span.name:
                    rejected += 1
                    continue
                attributes = _attributes(span.attributes)
                request_id = attributes.get(SpanAttr.REQUEST_ID)
                model = attributes.get(SpanAttr.MODEL)
                found.append(
                    SpanRecord(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex() if span.parent_span_id else None,
                        name=span.name[:256],
                        service=service[:128],
                        instance=str(instance)[:128] if instance else None,
                        kind=int(span.kind),
                        start_ns=int(span.start_time_unix_nano),
                        end_ns=int(span.end_time_unix_nano),
                        status=_STATUS.get(span.status.code, "unset"),
                        message=span.status.message[:1024],
                        attributes=attributes,
                        links=tuple(
                            (link.trace_id.hex(), link.span_id.hex())
                            for link in span.links
                            if len(link.trace_id) == 16 and len(link.span_id) == 8
                        ),
                        request_id=str(request_id)[:128] if request_id else None,
                        model=str(model)[:128] if model else None,
                    )
                )
    return found, rejected


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP/gRPC `Export`: the spans go to the store (off the event loop)."""

    def __init__(self, store: TraceStore) -> None:
        self.store = store

    async def Export(  # noqa: N802 (OTLP's name)
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        spans, rejected = spans_of(request)
        if spans:
            await asyncio.to_thread(self.store.add, spans)
        answer = trace_service_pb2.ExportTraceServiceResponse()
        if rejected:
            answer.partial_success.rejected_spans = rejected
            answer.partial_success.error_message = (
                f"{rejected} spans without a 16-byte trace id, an 8-byte span id or a name"
            )
        return answer


async def build_server(
    spec: ResolvedSpec, *, prune_interval_s: float = PRUNE_INTERVAL_S
) -> ServiceServer:
    """The receiver of `spec`'s embedded store, on its port; retention runs in the background."""
    if spec.embedded_trace_store_port is None:
        raise ValueError("the spec runs no embedded trace store (tracing off, or a collector)")
    store = TraceStore(store_path(spec.state_dir))
    server = ServiceServer(
        "tracestore",
        # Every interface a container's peers reach (discovery.listen_host), else the host.
        host=spec.listen_host,
        port=spec.embedded_trace_store_port,
        max_message_bytes=spec.limits.max_message_bytes,
        # Spans name requests and entities: only mesh certificates may send them.
        credentials=serving_credentials(spec, TRACE_STORE_IDENTITY),
    )
    server.add_service(
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server,
        TraceReceiver(store),
        TRACE_SERVICE,
    )
    retention = spec.tracing.retention

    async def keep_within_retention() -> None:
        while True:
            deleted = await asyncio.to_thread(
                store.prune, spec.tracing.retention_s, retention.max_mb * 1024 * 1024
            )
            if deleted:
                log.info("retention", extra={"deleted_spans": deleted})
            await asyncio.sleep(prune_interval_s)

    task = asyncio.get_running_loop().create_task(keep_within_retention())

    async def stop() -> None:
        task.cancel()
        store.close()

    server.on_stop(stop)
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the embedded OTLP trace store")
    parser.add_argument("--spec", required=True, help="resolved mesh spec (written by up)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    spec = load_resolved(args.spec)
    configure_logging("tracestore", args.log_level)

    async def build() -> ServiceServer:
        return await build_server(spec)

    run_service(build)
