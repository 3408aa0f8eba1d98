"""CPU per call of a server's call path (metrics, the tracing decision, the credential and
fault checks, error mapping): a method's wrapped handler against the same handler bare, in
one process, taking turns in each repeat.

    python -m tests.metrics.bench_call_path [--calls 20000] [--repeats 5]

Prints each repeat's overhead (wrapped minus bare, CPU time per call), the median and the
min-max. A benchmark, not a test: it asserts nothing about time (the call path's counting
is tests/metrics/test_overhead.py's).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc

from servemesh.services.runtime.call_path import CallPath
from servemesh.services.runtime.control_auth import ControlAuth
from servemesh.services.runtime.faults import FaultInjector
from servemesh.services.runtime.metrics import ServiceMetrics
from tests.metrics.test_overhead import METHOD, Context, answer


async def cpu_per_call(handler: grpc.RpcMethodHandler, calls: int) -> float:
    context = Context()
    started = time.process_time()
    for _ in range(calls):
        await handler.unary_unary(b"", context)
    return (time.process_time() - started) / calls


async def measure(calls: int, repeats: int) -> list[tuple[float, float]]:
    """(bare, wrapped) CPU seconds per call, one pair a repeat."""
    path = CallPath(
        metrics=ServiceMetrics("gateway"), control=ControlAuth(None), faults=FaultInjector()
    )
    handler = grpc.unary_unary_rpc_method_handler(answer)
    wrapped = path.wrap(METHOD, handler)
    await cpu_per_call(wrapped, calls)  # bind the method's children once, warm the caches
    found = []
    for _ in range(repeats):
        found.append((await cpu_per_call(handler, calls), await cpu_per_call(wrapped, calls)))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.metrics.bench_call_path")
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pairs = asyncio.run(measure(args.calls, args.repeats))
    overheads = [(wrapped - bare) * 1e6 for bare, wrapped in pairs]
    for index, ((bare, wrapped), over) in enumerate(zip(pairs, overheads, strict=True), 1):
        print(f"#{index}: bare {bare * 1e6:.1f} us, wrapped {wrapped * 1e6:.1f} us, +{over:.1f} us")
    print(
        f"call path: +{statistics.median(overheads):.1f} us CPU per call "
        f"(min-max {min(overheads):.1f}-{max(overheads):.1f}, {len(overheads)} repeats "
        f"of {args.calls:,} calls)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
