"""Child processes: the one place servemesh starts, watches and stops them.

    sup = Supervisor(logs_dir)                  # one forking thread, logs per child
    sup.start("registry-0", argv, group="registry", ready=GrpcHealth(dial))
    sup.kill("registry-0"); sup.restart("registry-0")   # an outage and the way back
    sup.stop_all([["envoy"], ["gateway"], ...])          # tier by tier, by PID
    RedisServer(sup, data_dir).start()          # redis-server on a free port, PING-ready

- `Supervisor`: start a child (parent-death signal, own session, a log file), wait until
  it is ready (its log tail in the error when it dies or times out), signal, kill,
  restart it as first started, stop in tiers by PID (SIGTERM, grace, SIGKILL).
- `GrpcHealth`, `TcpPort`, `RedisPing`, `Check`, `All`: what "ready" means for a child.
- `restarts.RestartPolicy`, `restarts.Restarts`: crash-loop backoff for an owner that starts
  crashed children again (a kill() holds a child down: `Child.held`).
- `RedisServer`: a redis-server child: start, snapshot-and-kill outage, start again on
  its port; a primary or replica of a replicated store (`replicated`, `replica_of`).
- `sentinel.SentinelServer`: a Redis Sentinel watching a replicated store's primary.

Errors: `ProcessError` (no such child, still running, not running) and its subclass
`StartError` (a child exited or was not ready in time; the message carries its log tail).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servemesh.procs.ready import All, Check, GrpcHealth, Readiness, RedisPing, TcpPort
    from servemesh.procs.redis_server import (
        RedisServer,
        ensure_redis_password,
        redis_server_binary,
    )
    from servemesh.procs.supervisor import Child, ProcessError, StartError, Supervisor

# Imported when first asked for (PEP 562): the fork server (servemesh.procs.forkserver)
# runs inside this package and, running as a model pool's user, must not import what the
# supervisor or Redis need (redis-py, gRPC's health stubs) before it forks.
_FROM = {
    "All": "ready",
    "Check": "ready",
    "GrpcHealth": "ready",
    "Readiness": "ready",
    "RedisPing": "ready",
    "TcpPort": "ready",
    "RedisServer": "redis_server",
    "ensure_redis_password": "redis_server",
    "redis_server_binary": "redis_server",
    "Child": "supervisor",
    "ProcessError": "supervisor",
    "StartError": "supervisor",
    "Supervisor": "supervisor",
}

__all__ = [
    "All",
    "Check",
    "Child",
    "GrpcHealth",
    "ProcessError",
    "Readiness",
    "RedisPing",
    "RedisServer",
    "StartError",
    "Supervisor",
    "TcpPort",
    "ensure_redis_password",
    "redis_server_binary",
]


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
