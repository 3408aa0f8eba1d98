"""CPU per call of the server path every service pays, in one process: a trivial unary RPC
(a protobuf request in, one out) through a grpc.aio server on loopback, client and server
in the same process, in three settings measured round by round in one run.

    python -m tests.runtime.bench_server_path [--calls 3000] [--rounds 7]

bare:     grpc.aio.server with the method and nothing else (the floor)
chain:    six grpc.aio server interceptors as services had them (tracing, metrics, control
          credential, faults, error statuses, request decoding), each rebuilding the
          method's handler on every call
service:  ServiceServer as every service builds it now

Every call carries what Envoy sends (an x-request-id and an unsampled `traceparent`), and
an SDK tracer provider is installed (tracing on, default sampling), so the tracing step
reads the caller's trace context as in the mesh. CPU is the process's own (user + system,
time.process_time), client and server together; the client's share is the same in every
setting, so "over bare" is the server path's own cost. The settings are interleaved round
by round (this machine's speed drifts within a minute: only neighbours compare); the run
prints the median and min-max of each, and the ratio of the chain's cost over bare to the
service's, from this run alone.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc._cython import cygrpc  # its handler lookup, to time the server path alone
from grpc_health.v1 import health_pb2
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from servemesh.services.runtime import ServiceServer
from tests.runtime.legacy_chain import legacy_interceptors

SERVICE = "servemesh.bench.predict.Echo"
METHOD = f"/{SERVICE}/Echo"
# What Envoy puts on every call: its request id and a trace it did not sample.
METADATA = (
    ("x-request-id", "8d3c2a8e-5a3b-4b8e-9a41-2f0d6c1e7b55"),
    ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"),
)
REQUEST = health_pb2.HealthCheckRequest(service="bench")
ANSWER = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _echo(
    request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
) -> health_pb2.HealthCheckResponse:
    return ANSWER


def _register(_: object, server: grpc.aio.Server) -> None:
    """As generated code registers a service: a generic handler and the registered one."""
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(
            _echo,
            request_deserializer=health_pb2.HealthCheckRequest.FromString,
            response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


Started = tuple[int, Callable[[], Awaitable[None]]]


async def _bare() -> Started:
    server = grpc.aio.server()
    _register(None, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return port, lambda: server.stop(None)


async def _chain() -> Started:
    server = grpc.aio.server(interceptors=legacy_interceptors())
    _register(None, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return port, lambda: server.stop(None)


async def _service() -> Started:
    server = ServiceServer("bench", port=0, drain_grace_s=0.0)
    server.add_service(_register, None, SERVICE)
    port = await server.start()
    return port, lambda: server.server.stop(None)


SETTINGS: dict[str, Callable[[], Awaitable[Started]]] = {
    "bare": _bare,
    "chain": _chain,
    "service": _service,
}


Echo = Callable[..., Awaitable[Any]]


async def _call_rounds(rounds: int, calls: int, block: int) -> dict[str, list[float]]:
    """µs of process CPU per call over loopback, per setting and round. All three servers
    run at once and the settings take turns every `block` calls, so each round's settings
    meet the same machine (its speed drifts, and others' load comes and goes)."""
    started = {name: await start() for name, start in SETTINGS.items()}
    channels = {
        name: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for name, (port, _) in started.items()
    }
    seen: dict[str, list[float]] = {name: [] for name in SETTINGS}
    try:
        echoes: dict[str, Echo] = {
            name: channel.unary_unary(
                METHOD,
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            for name, channel in channels.items()
        }
        names = list(echoes)
        for echo in echoes.values():
            for _ in range(200):
                await echo(REQUEST, metadata=METADATA)
        for _ in range(rounds):
            used = dict.fromkeys(SETTINGS, 0.0)
            gc.collect()
            gc.disable()  # a collection would land in whichever setting runs then
            for turn in range(max(1, calls // block)):
                # Each setting goes first as often as the others: whichever follows a
                # switch of channel pays for it.
                order = names[turn % len(names) :] + names[: turn % len(names)]
                for name in order:
                    echo = echoes[name]
                    begun = time.process_time()
                    for _ in range(block):
                        await echo(REQUEST, metadata=METADATA)
                    used[name] += time.process_time() - begun
            gc.enable()
            for name, total in used.items():
                seen[name].append(total / (max(1, calls // block) * block) * 1e6)
    finally:
        for channel in channels.values():
            await channel.close()
        for _, stop in started.values():
            await stop()
    return seen


# --- the server path alone: grpc.aio's own handler lookup and the handler, no sockets -------


class _Context:
    """What the server path asks of a call's context, as a call that succeeds answers."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return METADATA

    def code(self) -> None:
        return None

    def time_remaining(self) -> None:
        return None


def _raw_handler() -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        _echo,
        request_deserializer=health_pb2.HealthCheckRequest.FromString,
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
    )


PathSetting = tuple[grpc.RpcMethodHandler, tuple[grpc.aio.ServerInterceptor, ...]]


def _path_settings() -> dict[str, PathSetting]:
    """Per setting: the handler registered for the method, and grpc.aio interceptors."""
    raw = _raw_handler()
    service = ServiceServer("bench", port=0)
    return {
        "bare": (raw, ()),
        "chain": (raw, tuple(legacy_interceptors())),
        "service": (service.call_path.wrap(METHOD, raw), ()),
    }


async def _path_cpu_per_call(setting: PathSetting, calls: int) -> float:
    """µs of process CPU per call of what grpc.aio runs for a call once its message is in:
    the handler lookup (cygrpc's own, interceptors included), decoding, the handler."""
    handler, interceptors = setting
    resolver = cygrpc._MethodResolver([], {METHOD: handler})
    body = REQUEST.SerializeToString()
    context = _Context()

    async def one() -> None:
        found = await cygrpc._find_method_handler(METHOD, METADATA, resolver, interceptors)
        request = found.request_deserializer(body) if found.request_deserializer else body
        found.response_serializer(await found.unary_unary(request, context))

    for _ in range(200):
        await one()
    gc.collect()
    gc.disable()
    started = time.process_time()
    for _ in range(calls):
        await one()
    used = time.process_time() - started
    gc.enable()
    return used / calls * 1e6


# --- report ---------------------------------------------------------------------------------


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} µs (min {min(values):6.1f}, max {max(values):6.1f})"


def _ratio(values: list[float]) -> str:
    return (
        f"{statistics.median(values):.2f}x (min {min(values):.2f}, max {max(values):.2f}, "
        f"{len(values)} rounds)"
    )


def report(title: str, seen: dict[str, list[float]]) -> None:
    print(title)
    bare = seen["bare"]
    # Over bare, round by round: each round's settings ran next to each other.
    over = {
        name: [value - floor for value, floor in zip(values, bare, strict=True)]
        for name, values in seen.items()
        if name != "bare"
    }
    for name, values in seen.items():
        extra = f"   over bare {_spread(over[name])}" if name in over else ""
        print(f"  {name:>8}: {_spread(values)}{extra}")
    ratios = [c / s for c, s in zip(over["chain"], over["service"], strict=True) if s > 0]
    if ratios:
        print(f"  server path cost, chain / service (over bare): {_ratio(ratios)}")
    totals = [c / s for c, s in zip(seen["chain"], seen["service"], strict=True)]
    print(f"  whole, chain / service: {_ratio(totals)}")


async def measure(calls: int, rounds: int, path_calls: int, block: int) -> None:
    paths = _path_settings()
    path_seen: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, setting in paths.items():
            path_seen[name].append(await _path_cpu_per_call(setting, path_calls))
    report("server path alone (handler lookup + handler, no sockets), CPU per call:", path_seen)
    call_seen = await _call_rounds(rounds, calls, block)
    report("whole call over loopback (client + server in this process), CPU per call:", call_seen)


async def main(calls: int, rounds: int, path_calls: int, block: int) -> None:
    # Tracing on at the mesh's default sampling: the server reads each caller's context.
    trace.set_tracer_provider(TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.01))))
    logging.basicConfig(level=logging.ERROR)
    await measure(calls, rounds, path_calls, block)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--path-calls", type=int, default=20000)
    parser.add_argument("--block", type=int, default=50)
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.rounds, args.path_calls, args.block))
