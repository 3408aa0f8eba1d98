"""What the server's call path costs a call (metrics, and the steps around them: the
tracing decision, the credential and fault checks, error mapping), measured in CPU time
against the same handler unwrapped, and that it counts and times every call once."""

from __future__ import annotations

import time
from typing import Any

import grpc

from servemesh.services.runtime.call_path import CallPath
from servemesh.services.runtime.control_auth import ControlAuth
from servemesh.services.runtime.faults import FaultInjector
from servemesh.services.runtime.metrics import ServiceMetrics

CALLS = 20_000
METHOD = "/servemesh.gateway.v1.Gateway/Predict"


class _Context:
    """What the call path asks of a servicer context: metadata and the status chosen."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def code(self) -> None:
        return None


async def _answer(request: Any, context: Any) -> Any:
    return request


async def _cpu_per_call(handler: grpc.RpcMethodHandler) -> float:
    context = _Context()
    started = time.process_time()
    for _ in range(CALLS):
        await handler.unary_unary(b"", context)
    return (time.process_time() - started) / CALLS


async def test_the_call_path_costs_a_call_microseconds_and_counts_every_call() -> None:
    metrics = ServiceMetrics("gateway")
    path = CallPath(metrics=metrics, control=ControlAuth(None), faults=FaultInjector())
    handler = grpc.unary_unary_rpc_method_handler(_answer)
    wrapped = path.wrap(METHOD, handler)  # built once, as the server registers it
    await _cpu_per_call(wrapped)  # bind the method's children once, warm the caches
    plain = min([await _cpu_per_call(handler) for _ in range(3)])
    measured = min([await _cpu_per_call(wrapped) for _ in range(3)])
    overhead_us = (measured - plain) * 1e6
    print(f"call path: {overhead_us:.1f} us CPU per call ({plain * 1e6:.1f} us unwrapped)")
    # Every call was counted and timed once.
    samples = {
        s.name: s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name in ("servemesh_rpc_requests_total", "servemesh_rpc_duration_seconds_count")
    }
    assert samples == {
        "servemesh_rpc_requests_total": 4 * CALLS,
        "servemesh_rpc_duration_seconds_count": 4 * CALLS,
    }
    # Tens of microseconds at most, against the ~1.2 ms of CPU a Predict may take across
    # the mesh (it passes four servers); a busy core stretches it, hence the margin.
    assert overhead_us < 150
