"""When a child is ready: a gRPC health check, an open TCP port, a Redis PING, or any check.

Each readiness answers `check()` quickly (True: ready now) and may hold a connection
between checks; `close()` drops it. The supervisor polls `check()` until it is true, the
child dies, or the deadline passes.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Protocol

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.identity.channels import Dial


class Readiness(Protocol):
    """What "ready" means for one child."""

    @property
    def description(self) -> str: ...

    def check(self) -> bool: ...

    def close(self) -> None: ...


class GrpcHealth:
    """grpc.health.v1 answers SERVING where `dial` leads (for `service`; "" is the whole
    server)."""

    def __init__(self, dial: Dial, service: str = "", timeout_s: float = 0.5) -> None:
        self.dial = dial
        self.address = dial.address
        self.service = service
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None

    @property
    def description(self) -> str:
        what = f" for {self.service}" if self.service else ""
        return f"gRPC health SERVING{what} at {self.address}"

    def check(self) -> bool:
        if self._channel is None:
            self._channel = self.dial.channel()
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=self.service), timeout=self.timeout_s
            )
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class TcpPort:
    """Something accepts TCP connections at host:port."""

    def __init__(self, host: str, port: int, timeout_s: float = 0.2) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s

    @property
    def description(self) -> str:
        return f"TCP port {self.host}:{self.port} open"

    def check(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=self.timeout_s):
                return True
        except OSError:
            return False

    def close(self) -> None:
        pass


class RedisPing:
    """Redis at `url` answers PING (and has finished loading its snapshot)."""

    def __init__(self, url: str, timeout_s: float = 0.2, password: str | None = None) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._password = password
        self._client: redis.Redis | None = None

    @property
    def description(self) -> str:
        return f"Redis PING at {self.url}"

    def check(self) -> bool:
        if self._client is None:
            self._client = redis.Redis.from_url(
                self.url,
                password=self._password,
                socket_connect_timeout=self.timeout_s,
                socket_timeout=self.timeout_s,
            )
        try:
            return bool(self._client.ping())
        except redis.exceptions.RedisError:  # refused, timed out, or still loading
            return False

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def answers_ok(url: str, timeout_s: float = 0.5) -> bool:
    """Whether GET `url` answers 200 now (an HTTP readiness endpoint: Prometheus's,
    Alertmanager's `/-/ready`), for a Check."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return bool(reply.status == 200)
    except (OSError, urllib.error.URLError):
        return False


class Check:
    """Any callable that says whether the child is ready (a file exists, a line is logged)."""

    def __init__(self, ready: Callable[[], bool], description: str) -> None:
        self._ready = ready
        self._description = description

    @property
    def description(self) -> str:
        return self._description

    def check(self) -> bool:
        return bool(self._ready())

    def close(self) -> None:
        pass


class All:
    """Every one of several readinesses, checked in order (e.g. Envoy's admin says ready,
    then a call through its edge reaches a gateway that answers SERVING)."""

    def __init__(self, *parts: Readiness) -> None:
        self.parts = parts

    @property
    def description(self) -> str:
        return ", then ".join(p.description for p in self.parts)

    def check(self) -> bool:
        return all(p.check() for p in self.parts)

    def close(self) -> None:
        for part in self.parts:
            part.close()
