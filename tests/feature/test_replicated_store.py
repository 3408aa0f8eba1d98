"""A replicated feature store against real Redis processes: a primary, a replica per zone
and a Sentinel per zone. Reads come from the zone's replica unless its lag is past the
view's max_age; writes reach whichever server the Sentinels name primary, before and after
a failover."""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.sentinel import Sentinel

from servemesh.procs import RedisServer, Supervisor
from servemesh.procs.redis_server import DISABLED_COMMANDS, replication_renames
from servemesh.procs.sentinel import SentinelServer, quorum_of
from servemesh.services.feature.health import EitherAnswers, RedisProbe, ping_client
from servemesh.services.feature.replica import ReplicaLag, lag_of
from servemesh.services.feature.store import RedisFeatureStore, StoreError
from servemesh.spec import SENTINEL_MASTER_NAME, WITNESS_SENTINEL, parse_spec, resolve
from servemesh.spec.features import sentinel_names
from tests.waiting import wait_until

FEATURES = ["a", "b"]
ZONES = ("zone-a", "zone-b")


@dataclass
class Store:
    primary: RedisServer
    replicas: dict[str, RedisServer]
    sentinels: dict[str, SentinelServer]

    @property
    def password(self) -> str:
        return self.primary.password

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return [(s.host, s.port) for s in self.sentinels.values()]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    root = tmp_path_factory.mktemp("replicated")
    with Supervisor(root / "logs") as supervisor:
        primary = RedisServer(supervisor, root / "primary", replicated=True)
        primary.start(timeout_s=15)
        at = f"{primary.host} {primary.port}"
        replicas = {
            zone: RedisServer(
                supervisor,
                root / f"replica-{zone}",
                name=f"redis-replica-{zone}",
                password_file=primary.password_path,
                replicated=True,
                replica_of=at,
            )
            for zone in ZONES
        }
        for replica in replicas.values():
            replica.start(timeout_s=15)
        sentinels = {
            zone: SentinelServer(
                supervisor,
                root / f"sentinel-{zone}",
                primary=at,
                password_file=primary.password_path,
                quorum=quorum_of(len(ZONES)),
                down_after_ms=1000,
                failover_timeout_ms=5000,
                name=f"redis-sentinel-{zone}",
            )
            for zone in ZONES
        }
        for sentinel in sentinels.values():
            sentinel.start(timeout_s=15)
        yield Store(primary, replicas, sentinels)


def test_every_server_persists_every_second_and_a_primary_keeps_failover_commands_secret(
    tmp_path: Path,
) -> None:
    server = RedisServer(
        Supervisor(tmp_path / "logs"), tmp_path, port=6400, replicated=True, replica_of="h 1"
    )
    lines = server.config_lines()
    assert {"appendonly yes", "appendfsync everysec", "replicaof h 1"} <= set(lines)
    renamed = replication_renames(server.password)
    for command in ("CONFIG", "REPLICAOF", "SLAVEOF"):
        assert f'rename-command {command} "{renamed[command]}"' in lines
    # A replica asks its primary for PSYNC: kept, behind the password.
    assert not any(line.startswith("rename-command PSYNC") for line in lines)
    single = RedisServer(Supervisor(tmp_path / "logs"), tmp_path, port=6400).config_lines()
    # A single store persists too: every second, in its own private data dir.
    assert {"appendonly yes", "appendfsync everysec"} <= set(single)
    assert all(f'rename-command {c} ""' in single for c in DISABLED_COMMANDS)


def test_the_sentinels_config_names_the_primary_a_majority_and_the_secret_commands(
    tmp_path: Path,
) -> None:
    sentinel = SentinelServer(
        Supervisor(tmp_path / "logs"),
        tmp_path,
        primary="127.0.0.1 7000",
        password_file=tmp_path / "password",
        quorum=quorum_of(2),
        down_after_ms=1500,
        failover_timeout_ms=6000,
        port=7001,
    )
    lines = sentinel.config_lines()
    name = SENTINEL_MASTER_NAME
    assert f"sentinel monitor {name} 127.0.0.1 7000 2" in lines
    assert f"sentinel down-after-milliseconds {name} 1500" in lines
    assert f"sentinel failover-timeout {name} 6000" in lines
    password = (tmp_path / "password").read_text().strip()
    assert (
        f"sentinel rename-command {name} CONFIG {replication_renames(password)['CONFIG']}" in lines
    )
    assert [quorum_of(n) for n in (1, 2, 3, 5)] == [1, 2, 2, 3]


FREE_PORTS = "ports: {edge: 0, mesh: 0, envoy_admin: 0, services_base: 0}\n"


def test_two_zones_get_a_witness_sentinel_and_an_odd_count_needs_none(tmp_path: Path) -> None:
    assert sentinel_names(["zone-a", "zone-b"], witness=True) == [
        "sentinel-zone-a",
        "sentinel-zone-b",
        WITNESS_SENTINEL,
    ]
    assert sentinel_names(["a", "b", "c"], witness=True) == [
        "sentinel-a",
        "sentinel-b",
        "sentinel-c",
    ]
    assert sentinel_names(["zone-a", "zone-b"], witness=False) == [
        "sentinel-zone-a",
        "sentinel-zone-b",
    ]
    spec = resolve(
        parse_spec(f"state_dir: {tmp_path}\n{FREE_PORTS}feature_store: {{topology: replicated}}\n")
    )
    assert WITNESS_SENTINEL in spec.store_ports
    assert len(spec.sentinels) == 3 and len(set(spec.sentinels)) == 3
    plain = resolve(
        parse_spec(
            f"state_dir: {tmp_path}\n{FREE_PORTS}"
            "feature_store: {topology: replicated, witness_sentinel: false}\n"
        )
    )
    assert len(plain.sentinels) == 2


def test_lag_reads_zero_for_a_primary_and_infinite_while_the_link_is_down() -> None:
    assert lag_of({"role": "master"}) == 0.0
    assert lag_of({"role": "slave", "master_link_status": "down"}) == math.inf
    up = {"role": "slave", "master_link_status": "up", "master_last_io_seconds_ago": 3}
    assert lag_of(up) == 3.0


async def _close(*clients: aioredis.Redis) -> None:
    for client in clients:
        await client.aclose()


def _clients(store: Store, zone: str) -> tuple[aioredis.Redis, aioredis.Redis, Sentinel]:
    sentinel = Sentinel(
        store.sentinel_addresses(),
        sentinel_kwargs={"password": store.password},
        password=store.password,
        socket_connect_timeout=1.0,
    )
    writer = sentinel.master_for(SENTINEL_MASTER_NAME, redis_class=aioredis.Redis)
    replica = store.replicas[zone]
    reader = aioredis.Redis(host=replica.host, port=replica.port, password=store.password)
    return writer, reader, sentinel


async def _load(feature_store: RedisFeatureStore, value: float, n: int = 3) -> int:
    staged = await feature_store.begin_load("v", FEATURES, "test")
    ids = [f"e-{i}" for i in range(n)]
    await staged.add(ids, np.full((n, 2), value, np.float32), np.ones(n, np.int64))
    return (await staged.commit()).version


async def test_reads_come_from_the_zone_replica_and_go_to_the_primary_past_max_age(
    store: Store,
) -> None:
    writer, reader, sentinel = _clients(store, "zone-a")
    lag = [0.0]
    feature_store = RedisFeatureStore(writer, "r1", reader=reader, lag_s=lambda: lag[0])
    await _load(feature_store, 1.0)
    with store.replicas["zone-a"].client() as replica_client:

        def replicated() -> bool:
            return replica_client.get("r1:v:current") is not None

        wait_until(replicated, "the load's pointer on the zone's replica")
    version, rows = await feature_store.read("v", ["e-0"], max_age_ms=60_000)
    assert version is not None and rows is not None
    assert rows.values.tolist() == [[1.0, 1.0]]
    assert not feature_store.reads_primary(60_000)
    lag[0] = 120.0  # two minutes behind: a view allowing one reads the primary
    assert feature_store.reads_primary(60_000)
    assert not feature_store.reads_primary(None)
    version, rows = await feature_store.read("v", ["e-1"], max_age_ms=60_000)
    assert rows is not None and rows.values.tolist() == [[1.0, 1.0]]
    replica = store.replicas["zone-a"]
    seen: list[float] = []
    watch = ReplicaLag(
        aioredis.Redis(host=replica.host, port=replica.port, password=store.password),
        on_change=seen.append,
    )
    assert await watch.poll() < 5.0 and seen == [watch()]
    await watch.close()
    await _close(writer, reader, *sentinel.sentinels)


async def test_a_load_is_acknowledged_once_a_replica_holds_it_and_says_so_when_none_does(
    store: Store,
) -> None:
    writer, reader, sentinel = _clients(store, "zone-a")
    feature_store = RedisFeatureStore(
        writer, "r3", reader=reader, load_ack_replicas=1, load_ack_timeout_ms=2000
    )
    staged = await feature_store.begin_load("v", FEATURES, "test")
    await staged.add(["e-0"], np.ones((1, 2), np.float32), np.ones(1, np.int64))
    done = await staged.commit()
    assert done.replicas_acked is not None and done.replicas_acked >= 1
    # Acknowledged means held: the replicas have the swap at once, no waiting on them here.
    held = []
    for replica in store.replicas.values():
        with replica.client() as client:
            held.append(client.get("r3:v:current"))
    assert str(done.version).encode() in held, held

    # No replica answering (both stopped): the wait times out, the load is current on the
    # primary all the same, and the result says no replica held it.
    supervisor = store.primary.supervisor
    for replica in store.replicas.values():
        supervisor.send_signal(replica.name, signal.SIGSTOP)
    try:
        staged = await feature_store.begin_load("v", FEATURES, "test")
        await staged.add(["e-0"], np.full((1, 2), 2.0, np.float32), np.ones(1, np.int64))
        began = time.monotonic()
        late = await staged.commit()
        waited = time.monotonic() - began
    finally:
        for replica in store.replicas.values():
            supervisor.send_signal(replica.name, signal.SIGCONT)
    assert late.replicas_acked == 0 and waited >= 1.9, (late, waited)
    with store.primary.client() as client:
        assert client.get("r3:v:current") == str(late.version).encode()
    await _close(writer, reader, *sentinel.sentinels)


# 11 s of Sentinel noticing a lost replica: the whole suite runs it, not the fast lane.
@pytest.mark.slow
async def test_a_lost_zone_replica_is_read_around_through_the_primary(store: Store) -> None:
    writer, reader, sentinel = _clients(store, "zone-a")
    feature_store = RedisFeatureStore(writer, "r4", reader=reader, lag_s=lambda: 0.0)
    await _load(feature_store, 3.0)
    replica = store.replicas["zone-a"]
    # A store that has read nothing yet (no cached version), and the health probe the
    # service runs: neither may depend on the zone's replica alone.
    fresh_reader = aioredis.Redis(host=replica.host, port=replica.port, password=store.password)
    fresh = RedisFeatureStore(writer, "r4", reader=fresh_reader, lag_s=lambda: 0.0)
    probe = EitherAnswers(
        RedisProbe(ping_client(replica.url, password=store.password)), RedisProbe(writer)
    )
    replica.outage()
    try:
        with pytest.raises((redis.exceptions.ConnectionError, OSError)):
            await reader.ping()
        for each in (feature_store, fresh):
            version, rows = await each.read("v", ["e-0", "e-2"], max_age_ms=60_000)
            assert version is not None and rows is not None
            assert rows.values.tolist() == [[3.0, 3.0], [3.0, 3.0]]
        assert (await probe()).ok
        # Neither side answering: the probe says so, naming both.
        alone = EitherAnswers(
            RedisProbe(ping_client(replica.url, password=store.password)),
            RedisProbe(ping_client(replica.url, password=store.password)),
        )
        verdict = await alone()
        assert not verdict.ok and verdict.reason.count("PING failed") == 2, verdict
    finally:
        replica.start(timeout_s=15)
    await _close(writer, reader, fresh_reader, *sentinel.sentinels)


async def test_writes_follow_the_primary_the_sentinels_promote(store: Store) -> None:
    writer, reader, sentinel = _clients(store, "zone-b")
    feature_store = RedisFeatureStore(writer, "r2", reader=reader)
    await _load(feature_store, 1.0)
    killed_at = time.monotonic()
    store.primary.outage()

    # A load, tried again until a promoted replica takes it (each try fails at once
    # while there is no primary: refused connections, READONLY).
    while True:
        try:
            await _load(feature_store, 2.0)
            break
        except (redis.exceptions.RedisError, OSError, StoreError):
            assert time.monotonic() - killed_at < 30, "no primary took the load in 30 s"
            await asyncio.sleep(0.05)
    # How soon is a figure for docs/features.md (printed below), not a bound a shared box
    # could keep.
    took = time.monotonic() - killed_at
    for zone, replica in store.replicas.items():
        with replica.client() as client:

            def new_rows(client: redis.Redis = client) -> bool:
                value = client.get("r2:v:current")
                return value is not None and int(value) == 2

            wait_until(new_rows, f"the new load on {zone}'s server")
    version, rows = await feature_store.read("v", ["e-0"])
    assert rows is not None and rows.values.tolist() == [[2.0, 2.0]]
    print(f"failover: a load accepted {took:.2f} s after the primary's SIGKILL")
    await _close(writer, reader, *sentinel.sentinels)
