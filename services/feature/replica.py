"""A replicated store (feature_store.topology: replicated): the zone's replica for reads,
the primary found through Sentinel for writes, and how far behind the replica is.

Reads go to the zone's replica while its lag is within the view's max_age (the store
compares, `RedisFeatureStore.reads_primary`); writes always go to whichever server the
Sentinels name primary, so a failover is followed with no restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from servemesh.spec import SENTINEL_MASTER_NAME, ResolvedSpec

# How long a read waits on the zone's replica before it asks the primary (a local Redis
# answers a read in well under a millisecond; this only judges a stalled one).
REPLICA_READ_TIMEOUT_S = 1.0
# How often the replica's lag is read (one INFO replication on a connection of its own).
LAG_POLL_S = 0.5
LAG_TIMEOUT_S = 1.0


def lag_of(info: dict[str, object]) -> float:
    """The replica's lag in seconds from its INFO replication: 0 for a primary (a promoted
    replica), +Inf while its link to the primary is down."""
    if info.get("role") == "master":
        return 0.0
    if info.get("master_link_status") != "up":
        return math.inf
    try:
        return float(str(info.get("master_last_io_seconds_ago", "inf")))
    except ValueError:
        return math.inf


class ReplicaLag:
    """The zone replica's lag, read every LAG_POLL_S; +Inf until the first answer and
    whenever the replica does not answer. `on_change` gets every new value (the gauge)."""

    def __init__(
        self,
        client: aioredis.Redis,
        on_change: Callable[[float], None] | None = None,
        interval_s: float = LAG_POLL_S,
    ) -> None:
        self.client = client
        self.on_change = on_change
        self.interval_s = interval_s
        self.lag_s = math.inf
        self._task: asyncio.Task[None] | None = None

    def __call__(self) -> float:
        return self.lag_s

    async def poll(self) -> float:
        """Read the lag once (and remember it)."""
        try:
            info = await asyncio.wait_for(self.client.info("replication"), LAG_TIMEOUT_S)
            self.lag_s = lag_of(info)
        except (TimeoutError, redis.exceptions.RedisError, OSError):
            self.lag_s = math.inf
        if self.on_change is not None:
            self.on_change(self.lag_s)
        return self.lag_s

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.aclose()


@dataclass
class StoreClients:
    """The clients of a zone's feature service: `writer` to the primary, `reader` to the
    zone's replica (the same client for a single Redis), and the replica's `lag`."""

    writer: aioredis.Redis
    reader: aioredis.Redis
    read_url: str
    lag: ReplicaLag | None = None
    sentinel: Sentinel | None = None

    async def close(self) -> None:
        if self.lag is not None:
            await self.lag.close()
        if self.sentinel is not None:
            for client in self.sentinel.sentinels:
                await client.aclose()
        if self.reader is not self.writer:
            await self.reader.aclose()
        await self.writer.aclose()


def store_clients(spec: ResolvedSpec, zone: str) -> StoreClients:
    """The clients `zone`'s feature services use, for the spec's store topology."""
    password = spec.redis_password()
    common = {"password": password, "socket_connect_timeout": 1.0, "health_check_interval": 10}
    replica = spec.store_replica(zone)
    if spec.feature_store.topology != "replicated" or replica is None:
        client = aioredis.Redis.from_url(spec.redis_url, **common)  # type: ignore[arg-type]
        return StoreClients(client, client, spec.redis_url)
    sentinel = Sentinel(
        spec.sentinels,
        sentinel_kwargs={"password": password, "socket_timeout": 1.0},
        password=password,
        socket_connect_timeout=1.0,
        socket_timeout=5.0,
    )
    writer = sentinel.master_for(SENTINEL_MASTER_NAME, redis_class=aioredis.Redis)
    host, port = replica
    # No retries of its own: a read the replica cannot answer goes to the primary at once
    # (RedisFeatureStore.read). redis-py's default (ten tries, backing off to a second)
    # held each read of a killed replica for seconds, past the caller's deadline.
    reader = aioredis.Redis(
        host=host,
        port=port,
        retry=Retry(NoBackoff(), 0),
        # A stalled replica (paused, cut off) answers nothing: a read gives up on it in a
        # second and asks the primary, rather than waiting out the caller's deadline.
        socket_timeout=REPLICA_READ_TIMEOUT_S,
        **common,  # type: ignore[arg-type]
    )
    lag = ReplicaLag(
        aioredis.Redis(
            host=host,
            port=port,
            password=password,
            socket_connect_timeout=LAG_TIMEOUT_S,
            socket_timeout=LAG_TIMEOUT_S,
            single_connection_client=True,
        )
    )
    return StoreClients(writer, reader, f"redis://{host}:{port}/0", lag, sentinel)
