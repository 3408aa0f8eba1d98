"""The feature store's clients (servemesh/spec/store_clients.py) against real Redis
processes: a writer built for a replicated store keeps writing after its primary is killed
and a replica promoted, with no new client; a zone's reader reads its replica; a single
store's clients are its address, as before."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis
import redis.exceptions

from servemesh.spec import MeshSpec, Ports, ResolvedSpec
from servemesh.spec.resolve import resolve
from servemesh.spec.store_clients import (
    store_reader_sync,
    store_sentinels,
    store_writer,
    store_writer_sync,
)
from tests.feature.test_replicated_store import ZONES, Store
from tests.feature.test_replicated_store import store as replicated_store
from tests.waiting import wait_until

__all__ = ["replicated_store"]


def _spec(store: Store, topology: str = "replicated") -> ResolvedSpec:
    base = resolve(MeshSpec(ports=Ports.free()))
    primary = store.primary
    feature_store = base.feature_store.model_copy(
        update={
            "topology": topology,
            "redis_url": f"redis://{primary.host}:{primary.port}/0",
            "password_file": str(primary.password_path),
        }
    )
    ports: dict[str, int] = {}
    if topology == "replicated":
        for zone in base.zones:
            # Every zone of the spec names one of the store's replicas and Sentinels.
            at = ZONES[base.zones.index(zone) % len(ZONES)]
            ports[f"replica-{zone}"] = store.replicas[at].port
            ports[f"sentinel-{zone}"] = store.sentinels[at].port
    return base.model_copy(
        update={"feature_store": feature_store, "store_ports": ports, "host": primary.host}
    )


@pytest.fixture
def spec(replicated_store: Store) -> Iterator[ResolvedSpec]:
    yield _spec(replicated_store)


def test_a_single_store_s_clients_are_its_address(replicated_store: Store) -> None:
    single = _spec(replicated_store, "single")
    assert store_sentinels(single) == []
    writer = store_writer_sync(single)
    reader = store_reader_sync(single, single.zones[0])
    try:
        kwargs = writer.connection_pool.connection_kwargs
        assert (kwargs["host"], kwargs["port"]) == (
            replicated_store.primary.host,
            replicated_store.primary.port,
        )
        assert kwargs["password"] == replicated_store.password
        assert writer.set("single:k", "1") and reader.get("single:k") == b"1"
    finally:
        writer.close()
        reader.close()


async def test_a_writer_keeps_writing_after_the_primary_is_killed(
    replicated_store: Store, spec: ResolvedSpec
) -> None:
    writer = store_writer(spec)
    sync_writer = store_writer_sync(spec)
    assert len(store_sentinels(spec)) == len(spec.zones)
    await writer.set("w:before", "1")
    assert sync_writer.get("w:before") == b"1"
    killed_at = time.monotonic()
    replicated_store.primary.outage()

    # The same clients, tried again until a promoted replica takes the write (refused
    # connections, READONLY or no primary named while the Sentinels agree).
    while True:
        try:
            await writer.set("w:after", "2")
            break
        except (redis.exceptions.RedisError, OSError):
            assert time.monotonic() - killed_at < 60, "no primary took the write in 60 s"
            await asyncio.sleep(0.1)
    while True:
        try:
            sync_writer.set("w:after-sync", "3")
            break
        except (redis.exceptions.RedisError, OSError):
            assert time.monotonic() - killed_at < 60, "no primary took the write in 60 s"
            await asyncio.sleep(0.1)
    assert await writer.get("w:after") == b"2"
    assert sync_writer.get("w:after-sync") == b"3"
    for zone in spec.zones:
        reader = store_reader_sync(spec, zone)
        try:

            def written(reader: redis.Redis = reader) -> bool:
                return reader.get("w:after-sync") == b"3"

            wait_until(written, f"the write on {zone}'s server")
        finally:
            reader.close()
    await writer.aclose()
    sync_writer.close()
