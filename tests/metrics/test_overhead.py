"""A server's call path (metrics, and the steps around them: the tracing decision, the
credential and fault checks, error mapping) counts and times every call once. What it costs
a call in CPU is measured by tests/metrics/bench_call_path.py, a benchmark, not here."""

from __future__ import annotations

from typing import Any

import grpc

from servemesh.services.runtime.call_path import CallPath
from servemesh.services.runtime.control_auth import ControlAuth
from servemesh.services.runtime.faults import FaultInjector
from servemesh.services.runtime.metrics import ServiceMetrics

CALLS = 2_000
METHOD = "/servemesh.gateway.v1.Gateway/Predict"


class Context:
    """What the call path asks of a servicer context: metadata and the status chosen."""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def code(self) -> None:
        return None


async def answer(request: Any, context: Any) -> Any:
    return request


async def test_the_call_path_counts_and_times_every_call_once() -> None:
    metrics = ServiceMetrics("gateway")
    path = CallPath(metrics=metrics, control=ControlAuth(None), faults=FaultInjector())
    wrapped = path.wrap(METHOD, grpc.unary_unary_rpc_method_handler(answer))
    context = Context()
    for index in range(CALLS):
        assert await wrapped.unary_unary(index.to_bytes(2, "big"), context) == index.to_bytes(
            2, "big"
        )
    samples = {
        s.name: s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name in ("servemesh_rpc_requests_total", "servemesh_rpc_duration_seconds_count")
    }
    assert samples == {
        "servemesh_rpc_requests_total": CALLS,
        "servemesh_rpc_duration_seconds_count": CALLS,
    }
