"""The one record of a load run, and the one function that times a request into it.

Every load in servemesh (benchmarks, tests, the drills' background load) records an
`Outcome` per request through `timed`, so they all mean the same thing by latency: from the
time the request was *due* to the time its answer came back. A client that falls behind
its schedule, or a server that stalls, therefore shows up as latency; how late the request
actually left is kept beside it as `lag_ms`, so a saturated client is visible too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

OK = "OK"
# Not a gRPC status: the client refused to send because too many calls were outstanding.
CLIENT_OVERLOADED = "CLIENT_OVERLOADED"


@dataclass(frozen=True)
class Outcome:
    """One request, on its run's clock (seconds since the run's time zero)."""

    sent_s: float  # when it was due to leave (open loop: the schedule; closed: when it left)
    latency_ms: float  # answer received minus `sent_s`; NaN when it never left
    code: str  # "OK", a gRPC status name, or CLIENT_OVERLOADED
    version: str = ""  # who answered, when the reply says so (Predict does)
    replica: str = ""
    zone: str = ""
    degraded: bool = False
    degraded_reason: str = ""  # why the gateway answered with its fallback (its hop: error)
    lag_ms: float = 0.0  # how late it actually left after `sent_s`
    index: int = -1  # its number in the schedule (request bodies and deadlines cycle on it)

    @property
    def ok(self) -> bool:
        return self.code == OK


@dataclass(frozen=True)
class Reply:
    """Who answered a successful request (empty for calls whose answer is not parsed)."""

    version: str = ""
    replica: str = ""
    zone: str = ""
    degraded: bool = False
    degraded_reason: str = ""


NO_REPLY = Reply()

# Sends request number `index` and returns who answered; a gRPC failure is raised as
# grpc.aio.AioRpcError (timed() turns it into the outcome's code).
Request = Callable[[int], Awaitable[Reply]]


async def timed(request: Request, index: int, *, due: float, origin: float) -> Outcome:
    """Run request `index`, due at perf_counter() time `due`; never raises for a gRPC error.

    The latency counts from `due`, not from when this coroutine got to run: time a request
    spent waiting for a busy client to send it is time its caller would have waited.
    """
    left = time.perf_counter()
    code, reply = OK, NO_REPLY
    try:
        reply = await request(index)
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
    done = time.perf_counter()
    return Outcome(
        sent_s=due - origin,
        latency_ms=(done - due) * 1000,
        code=code,
        version=reply.version,
        replica=reply.replica,
        zone=reply.zone,
        degraded=reply.degraded,
        degraded_reason=reply.degraded_reason,
        lag_ms=max(0.0, left - due) * 1000,
        index=index,
    )


def refused(index: int, *, due: float, origin: float) -> Outcome:
    """A request the client did not send because it had too many outstanding."""
    return Outcome(due - origin, math.nan, CLIENT_OVERLOADED, index=index)
