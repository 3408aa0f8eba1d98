"""Streams on a running mesh: `servemesh up` starts a consumer per spec'd stream; events
are scored through the gateways (mode mesh) or in the consumer (in_process, the model in a
sandboxed child of it); a consumer SIGKILLed mid-stream and restarted leaves exactly one
output per event; `stream status`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from servemesh.launcher import Mesh
from servemesh.observe.cpu import descendants
from servemesh.spec import DemoSpec, MeshSpec, MetricsSpec, Ports, Replicas, StreamSpec
from servemesh.streams.events import Event
from servemesh.streams.keys import StreamKeys
from servemesh.streams.metrics import read_lag_now
from servemesh.streams.predict import InProcessPredictor, Prediction
from tests.sandbox.spy import sandbox_spy, status_of
from tests.waiting import wait_until

ENTITIES = 200


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    state_dir = tmp_path_factory.mktemp("stream-mesh")
    one = Replicas(per_zone={"zone-a": 1})
    spec = MeshSpec(
        zones=["zone-a"],
        ports=Ports.free(),
        state_dir=str(state_dir),
        gateway=one,
        feature=one,
        model_servers=one,
        demo=DemoSpec(entities=ENTITIES),
        metrics=MetricsSpec(prometheus="off"),
        streams=[
            StreamSpec(name="events", model="fraud", mode="mesh"),
            StreamSpec(name="local", model="fraud", mode="in_process"),
        ],
    )
    with Mesh.from_spec(spec) as running:
        yield running


def client(mesh: Mesh) -> redis.Redis:
    return redis.Redis.from_url(mesh.spec.redis_url, password=mesh.spec.redis_password())


def send(r: redis.Redis, keys: StreamKeys, n: int, **fields: str) -> list[str]:
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        event: dict[Any, Any] = dict(fields) or {"entity": f"user-{i % ENTITIES}"}
        pipe.xadd(keys.input, event)
    return [i.decode() for i in pipe.execute()]


def outputs_of(r: redis.Redis, key: str, ids: list[str]) -> Counter[str]:
    wanted = set(ids)
    entries: Any = r.xrange(key)
    return Counter(e for _, f in entries if (e := f[b"event"].decode()) in wanted)


def settled(r: redis.Redis, keys: StreamKeys) -> bool:
    lag = read_lag_now(r, keys)
    return lag is not None and lag.settled


@pytest.mark.parametrize("name", ["events", "local"])
def test_events_are_scored_once_and_poison_is_dead_lettered(mesh: Mesh, name: str) -> None:
    keys = StreamKeys.of(mesh.spec.stream(name))
    with client(mesh) as r:
        ids = send(r, keys, 300)
        bad = send(r, keys, 1, entity="nobody-here")
        wait_until(lambda: settled(r, keys), f"stream {name} to settle", timeout_s=60)
        counts = outputs_of(r, keys.output, ids)
        dead: Any = r.xrange(keys.dead_letter)
        reasons = {f[b"event"].decode(): f[b"reason"].decode() for _, f in dead}
        lost = sorted(set(ids) - set(counts))
        why = {i: reasons.get(i, "no dead letter either") for i in lost[:5]}
        assert not lost, f"{len(lost)} events without an output, e.g. {why}"
        assert set(counts.values()) == {1}, "an event with two outputs"
        assert "NOT_FOUND" in reasons[bad[0]] and "nobody-here" in reasons[bad[0]]
        entry: Any = r.xrange(keys.output, count=1)
        fields = {k.decode(): v.decode() for k, v in entry[0][1].items()}
        assert fields["model"] == "fraud" and fields["version"] == "v1"
        assert 0.0 <= json.loads(fields["outputs"])["score"] <= 1.0


def test_a_consumer_killed_mid_stream_and_restarted_loses_and_repeats_nothing(
    mesh: Mesh,
) -> None:
    name = "stream-events"
    keys = StreamKeys.of(mesh.spec.stream("events"))
    with client(mesh) as r:
        ids = send(r, keys, 2000)
        wait_until(lambda: r.xlen(keys.output) > 0, "the first outputs")
        mesh.kill(name, signal.SIGKILL)
        more = send(r, keys, 500)
        mesh.restart(name)
        wait_until(lambda: settled(r, keys), "the restarted consumer to catch up", timeout_s=90)
        counts = outputs_of(r, keys.output, ids + more)
        assert set(counts) == set(ids + more), "an event without an output"
        assert set(counts.values()) == {1}, "an event with two outputs"


def test_stream_status_prints_lag_and_throughput(mesh: Mesh) -> None:
    run = [sys.executable, "-m", "servemesh", "stream", "status", "--state-dir"]
    table = subprocess.run(
        [*run, str(mesh.state_dir)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "events" in table and "local" in table and "pending" in table
    as_json = subprocess.run(
        [*run, str(mesh.state_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    found = {s["name"]: s for s in json.loads(as_json)}
    assert set(found) == {"events", "local"}
    assert found["events"]["stats"]["consumer"] == "events-0"
    assert found["events"]["lag"]["pending"] == 0


def test_the_in_process_consumer_runs_the_model_in_a_sandboxed_child(mesh: Mesh) -> None:
    """The consumer holds the feature store's password; the model runs below it, confined
    (seccomp filter on), and, when the mesh runs as root, as another user."""
    consumer = mesh.pid("stream-local")
    children = [
        pid
        for pid in descendants(consumer)
        if b"servemesh.sandbox" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert children, "the in_process consumer runs no sandboxed child"
    status = status_of(children[-1])
    assert status["Seccomp"].strip() == "2"
    if os.geteuid() == 0:
        assert status["Uid"].split()[0] != status_of(consumer)["Uid"].split()[0]


async def test_the_in_process_predictor_loads_no_model_in_its_own_process(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    from servemesh.services.feature.store import RedisFeatureStore
    from servemesh.streams.predict import feature_store_client

    spy = sandbox_spy(monkeypatch)  # a model loaded in this process now raises
    spec = mesh.spec
    store = RedisFeatureStore(feature_store_client(spec), spec.feature_store.key_prefix)
    predictor = await InProcessPredictor.from_registry(spec, spec.stream("local"), store)
    try:
        answers = await predictor.predict([Event("1-0", "user-1", {}), Event("1-1", "user-2", {})])
    finally:
        await predictor.close()
    assert len(spy.opened) == 1 and spy.opened[0].seccomp == "2"
    assert all(isinstance(a, Prediction) and 0 <= a.outputs["score"] <= 1 for a in answers)
