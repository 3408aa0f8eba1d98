"""CPU per call of tracing, in one process: a grpc.aio echo server and client on loopback,
with the tracing steps every service runs (the server span of its call path, the client
span of its channels' interceptors) in five settings.

    python -m tests.tracing.bench_overhead [--calls 2000] [--rounds 5]

off:        no interceptors at all (the baseline)
no-sdk:     interceptors, no tracer provider (tracing.enabled: false): context passed on only
unsampled:  SDK provider, ratio 0, no caller trace context: non-recording spans
sampled:    SDK provider, ratio 1: every span recorded and exported (BatchSpanProcessor
            to an in-process OTLP receiver that decodes the spans and drops them)
passed-on:  what the request path does now (the gateway's calls): the server span step
            only, the caller's unsampled `traceparent` in the metadata, no client
            interceptors (SDK provider installed)
CPU is the process's own (user + system), client and server together, per call.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from servemesh.services.runtime.call_path import PathServer
from servemesh.services.runtime.interceptors import with_unary_behaviour
from servemesh.services.runtime.tracing import client_interceptors, span_name
from tests.runtime.legacy_chain import server_span_around


class _Echo(health_pb2_grpc.HealthServicer):
    async def Check(self, request, context):  # noqa: N802
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class _Drop(trace_service_pb2_grpc.TraceServiceServicer):
    async def Export(self, request, context):  # noqa: N802
        return trace_service_pb2.ExportTraceServiceResponse()


# A caller's trace that is not sampled, as Envoy sends for most requests.
UNSAMPLED = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"),)


def _traced(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler with the call path's tracing step only (the server span), built once."""
    if handler.unary_unary is None:
        return handler
    return with_unary_behaviour(handler, server_span_around(span_name(method), handler.unary_unary))


async def _run(calls: int, interceptors: bool, passed_on: bool = False) -> float:
    server: grpc.aio.Server = grpc.aio.server()
    if interceptors or passed_on:
        server = PathServer(server, _traced)
    health_pb2_grpc.add_HealthServicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", interceptors=client_interceptors() if interceptors else None
    )
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest()
    metadata = UNSAMPLED if passed_on else None
    for _ in range(200):  # warm up
        await stub.Check(request, metadata=metadata)
    started = time.process_time()
    for _ in range(calls):
        await stub.Check(request, metadata=metadata)
    used = time.process_time() - started
    await channel.close()
    await server.stop(None)
    return used / calls * 1e6


async def _rounds(
    calls: int, modes: dict[str, Callable[[], None]], rounds: int
) -> dict[str, float]:
    """Median µs per call of each mode, the modes interleaved round by round (this machine's
    speed drifts by tens of percent within a minute: only neighbours compare)."""
    seen: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(rounds):
        for name, prepare in modes.items():
            prepare()
            passed_on = name == "passed-on"
            seen[name].append(await _run(calls, name not in ("off", "passed-on"), passed_on))
    return {name: statistics.median(values) for name, values in seen.items()}


async def main(calls: int, rounds: int) -> None:
    def nothing() -> None:
        return None

    before = await _rounds(calls, {"off": nothing, "no-sdk": nothing}, rounds)
    collector = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Drop(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    await collector.start()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0)))
    exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{port}", insecure=True)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
    trace.set_tracer_provider(provider)

    def ratio(value: float) -> Callable[[], None]:
        def prepare() -> None:
            provider.sampler = ParentBased(TraceIdRatioBased(value))

        return prepare

    after = await _rounds(
        calls,
        {
            "off": nothing,
            "passed-on": ratio(0.0),
            "unsampled": ratio(0.0),
            "sampled": ratio(1.0),
        },
        rounds,
    )
    provider.shutdown()
    await collector.stop(None)
    for results in (before, after):
        base = results["off"]
        for name, us in results.items():
            print(f"{name:>10}: {us:7.1f} µs CPU per call  ({us - base:+6.1f} µs vs off)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.rounds))
