"""Clients of the feature store for whoever writes or reads it: the stream consumer, batch
scoring (in process and on each Dask worker), `servemesh cache`, the seeding at `up`.

- `store_writer` / `store_writer_sync`: a client for writing. A single store
  (feature_store.topology: single): its address, as the spec names it. A replicated store:
  the primary the Sentinels name, asked again on each new connection, so a failover is
  followed with no restart (a write in flight when the primary dies fails; the caller's own
  retry reaches the promoted replica).
- `store_reader` / `store_reader_sync`: a client for reading in a zone: the zone's replica
  of a replicated store, else the single store.

The password comes from the spec's feature_store.password_file, read at each call, as
ever; it never joins a URL. Closing a Sentinel-followed client also closes its connections
to the Sentinels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as async_sentinel
import redis.sentinel as sync_sentinel

from servemesh.spec.features import SENTINEL_MASTER_NAME
from servemesh.spec.resolve import ResolvedSpec

# How long a client waits for a new connection unless its caller says otherwise.
CONNECT_TIMEOUT_S = 2.0
# How long a Sentinel may take to name the primary (per Sentinel asked).
SENTINEL_TIMEOUT_S = 1.0

Address = tuple[str, int]


class SentinelWriter(aioredis.Redis):
    """A client of the primary the Sentinels name (asyncio); closing it closes its
    Sentinel connections too."""

    followed: async_sentinel.Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        if self.followed is not None:
            for client in self.followed.sentinels:
                await client.aclose()


class SentinelWriterSync(redis.Redis):
    """A client of the primary the Sentinels name; closing it closes its Sentinel
    connections too."""

    followed: sync_sentinel.Sentinel | None = None

    def close(self) -> None:
        super().close()
        if self.followed is not None:
            for client in self.followed.sentinels:
                client.close()


def _sentinel_kwargs(password: str | None) -> dict[str, Any]:
    return {"password": password, "socket_timeout": SENTINEL_TIMEOUT_S}


def writer_at(
    url: str,
    password: str | None,
    sentinels: Sequence[Address] = (),
    *,
    socket_connect_timeout: float = CONNECT_TIMEOUT_S,
    **options: Any,
) -> aioredis.Redis:
    """A client for writing (asyncio): the primary `sentinels` name, else `url`."""
    if not sentinels:
        return aioredis.Redis.from_url(
            url, password=password, socket_connect_timeout=socket_connect_timeout, **options
        )
    sentinel = async_sentinel.Sentinel(
        list(sentinels),
        sentinel_kwargs=_sentinel_kwargs(password),
        password=password,
        socket_connect_timeout=socket_connect_timeout,
        **options,
    )
    client = sentinel.master_for(SENTINEL_MASTER_NAME, redis_class=SentinelWriter)
    assert isinstance(client, SentinelWriter)
    client.followed = sentinel
    return client


def writer_at_sync(
    url: str,
    password: str | None,
    sentinels: Sequence[Address] = (),
    *,
    socket_connect_timeout: float = CONNECT_TIMEOUT_S,
    **options: Any,
) -> redis.Redis:
    """A client for writing: the primary `sentinels` name, else `url`."""
    if not sentinels:
        return redis.Redis.from_url(
            url, password=password, socket_connect_timeout=socket_connect_timeout, **options
        )
    sentinel = sync_sentinel.Sentinel(
        list(sentinels),
        sentinel_kwargs=_sentinel_kwargs(password),
        password=password,
        socket_connect_timeout=socket_connect_timeout,
        **options,
    )
    client = sentinel.master_for(SENTINEL_MASTER_NAME, redis_class=SentinelWriterSync)
    assert isinstance(client, SentinelWriterSync)
    client.followed = sentinel
    return client


def store_sentinels(spec: ResolvedSpec) -> list[Address]:
    """The Sentinels a writer follows: every one of a replicated store (each zone's, and
    the witness where there is one), none for a single store."""
    if spec.feature_store.topology != "replicated":
        return []
    return spec.sentinels


def store_writer(
    spec: ResolvedSpec, *, socket_connect_timeout: float = CONNECT_TIMEOUT_S, **options: Any
) -> aioredis.Redis:
    """A client for writing to the feature store (asyncio)."""
    return writer_at(
        spec.redis_url,
        spec.redis_password(),
        store_sentinels(spec),
        socket_connect_timeout=socket_connect_timeout,
        **options,
    )


def store_writer_sync(
    spec: ResolvedSpec, *, socket_connect_timeout: float = CONNECT_TIMEOUT_S, **options: Any
) -> redis.Redis:
    """A client for writing to the feature store."""
    return writer_at_sync(
        spec.redis_url,
        spec.redis_password(),
        store_sentinels(spec),
        socket_connect_timeout=socket_connect_timeout,
        **options,
    )


def _reader_address(spec: ResolvedSpec, zone: str) -> Address | None:
    if spec.feature_store.topology != "replicated":
        return None
    return spec.store_replica(zone)


def store_reader(
    spec: ResolvedSpec,
    zone: str,
    *,
    socket_connect_timeout: float = CONNECT_TIMEOUT_S,
    **options: Any,
) -> aioredis.Redis:
    """A client for reading in `zone` (asyncio): its replica, else the single store."""
    replica = _reader_address(spec, zone)
    if replica is None:
        return store_writer(spec, socket_connect_timeout=socket_connect_timeout, **options)
    host, port = replica
    return aioredis.Redis(
        host=host,
        port=port,
        password=spec.redis_password(),
        socket_connect_timeout=socket_connect_timeout,
        **options,
    )


def store_reader_sync(
    spec: ResolvedSpec,
    zone: str,
    *,
    socket_connect_timeout: float = CONNECT_TIMEOUT_S,
    **options: Any,
) -> redis.Redis:
    """A client for reading in `zone`: its replica, else the single store."""
    replica = _reader_address(spec, zone)
    if replica is None:
        return store_writer_sync(spec, socket_connect_timeout=socket_connect_timeout, **options)
    host, port = replica
    return redis.Redis(
        host=host,
        port=port,
        password=spec.redis_password(),
        socket_connect_timeout=socket_connect_timeout,
        **options,
    )
