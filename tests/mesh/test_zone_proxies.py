"""An Envoy per zone (`proxy.layout: per_zone`), on a real two-zone mesh: the edge and each
zone run an Envoy of their own, each holding only its part of the config; a route change
is confirmed by every one of them, and one that a stalled zone Envoy cannot confirm is
rolled back on all of them; with one zone's Envoy killed under load (each zone in turn),
the mesh starts it again, calls keep being answered throughout (through the other zone
meanwhile; OIP calls too), and the zone answers again once its Envoy is back. Every Envoy's listener
refuses strangers, and a certificate rotation is served by each of them."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.contract.wire import GATEWAY_CLUSTER, feature_cluster, mesh_route_config
from servemesh.identity import mesh_identity
from servemesh.launcher import Mesh, envoy_child
from servemesh.load.background import BackgroundLoad
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_view import served_split
from servemesh.spec import (
    EDGE_PROXY,
    DemoSpec,
    MeshSpec,
    ModelSpec,
    ModelVersionSpec,
    Ports,
    ProxySpec,
)
from servemesh.state.paths import ApplyError
from tests.mesh.edge_load import edge_load, oip_edge_load, zones_answering
from tests.mesh.tls_probe import (
    assert_rotation_served,
    assert_strangers_refused,
    rotate_all,
    serials,
)
from tests.waiting import wait_until

ZONES = ("zone-a", "zone-b")
START = {"v1": 100, "v2": 0}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    state = tmp_path_factory.mktemp("zone-proxies")
    spec = MeshSpec(
        ports=Ports.free(),
        state_dir=str(state),
        proxy=ProxySpec(layout="per_zone"),
        models={
            "fraud": ModelSpec(
                versions={
                    "v1": ModelVersionSpec(source="demo:1"),
                    "v2": ModelVersionSpec(source="demo:2"),
                },
                traffic=START,
            )
        },
        demo=DemoSpec(enabled=True, entities=50),
    )
    spec = spec.model_copy(
        update={"metrics": spec.metrics.model_copy(update={"prometheus": "off"})}
    )
    with Mesh.from_spec(spec, Path(state)) as running:
        yield running


@pytest.fixture
def routes(mesh: Mesh) -> Iterator[RouteManager]:
    manager = RouteManager(mesh.paths)
    yield manager
    if manager.live_spec().models["fraud"].traffic != START:
        manager.set_weights("fraud", START)


def test_each_zone_runs_an_envoy_of_its_own_holding_only_its_part(
    mesh: Mesh, routes: RouteManager
) -> None:
    pids = {name: mesh.pid(envoy_child(name)) for name in (EDGE_PROXY, *ZONES)}
    assert len(set(pids.values())) == 3, pids
    clusters = {name: set(admin.clusters()) for name, admin in routes.admins().items()}
    assert GATEWAY_CLUSTER in clusters[EDGE_PROXY]
    assert not any(c.endswith(ZONES) for c in clusters[EDGE_PROXY]), clusters[EDGE_PROXY]
    for zone, other in (ZONES, ZONES[::-1]):
        assert feature_cluster(zone) in clusters[zone]
        assert feature_cluster(other) not in clusters[zone]
        assert GATEWAY_CLUSTER not in clusters[zone]
        assert set(routes.admin_of(zone).route_configs()) >= {mesh_route_config(zone)}
        assert mesh_route_config(other) not in routes.admin_of(zone).route_configs()


def test_a_weight_change_is_confirmed_by_every_zones_envoy(
    mesh: Mesh, routes: RouteManager
) -> None:
    result = routes.set_weights("fraud", {"v1": 50, "v2": 50})
    for zone in ZONES:
        served = routes.admin_of(zone).served_versions()
        assert served.routes[mesh_route_config(zone)] == result.version


def _served_route(routes: RouteManager, zone: str) -> str:
    return routes.admin_of(zone).served_versions().routes[mesh_route_config(zone)]


def test_a_change_one_zones_envoy_cannot_confirm_is_rolled_back_on_every_envoy(
    mesh: Mesh, routes: RouteManager
) -> None:
    before = _served_route(routes, "zone-b")
    # A stalled Envoy: alive (the mesh does not start it again), answering nothing.
    mesh.send_signal(envoy_child("zone-a"), signal.SIGSTOP)
    try:
        routes.confirm_timeout_s = 2.0
        with pytest.raises(ApplyError, match="zone-a's Envoy"):
            routes.set_weights("fraud", {"v1": 20, "v2": 80})
    finally:
        mesh.send_signal(envoy_child("zone-a"), signal.SIGCONT)
    # Zone-b had taken the new routes; the files put back, it serves the old ones again.
    wait_until(
        lambda: _served_route(routes, "zone-b") == before,
        "zone-b's Envoy back on the routes it served before",
    )
    assert routes.live_spec().models["fraud"].traffic == START
    wait_until(lambda: _served_route(routes, "zone-a") == before, "zone-a's Envoy as it was")


def _kill_and_wait_back(mesh: Mesh, name: str, load: BackgroundLoad) -> tuple[float, float]:
    """SIGKILL the Envoy `name` under `load`; the mesh starts it again by itself (a new
    process, ready on its admin API). When it was killed and when it was back, on the
    load's clock."""
    old = mesh.pid(name)
    killed_at = load.now_s()
    mesh.kill(name, signal.SIGKILL, revive=True)
    wait_until(lambda: mesh.is_running(name) and mesh.pid(name) != old, f"{name} again")
    return killed_at, load.now_s()


@pytest.mark.parametrize("zone", ZONES)
def test_a_killed_zone_envoy_is_started_again_and_calls_keep_being_answered(
    mesh: Mesh, routes: RouteManager, zone: str
) -> None:
    name = envoy_child(zone)
    load = edge_load(mesh)
    load.start()
    try:
        wait_until(
            lambda: {o.zone for o in load.run.window(0.0)} >= set(ZONES), "both zones answering"
        )
        killed_at, back_at = _kill_and_wait_back(mesh, name, load)
        wait_until(
            lambda: zone in {o.zone for o in load.run.window(back_at)},
            f"{zone} answering again",
            timeout_s=30,
        )
        settled = load.now_s()
        wait_until(lambda: len(load.run.window(settled)) >= 20, "half a second more")
    finally:
        load.stop()
    assert not load.error
    outcomes = load.snapshot()
    failed = [o for o in outcomes if not o.ok]
    # A gateway whose zone's Envoy is gone says so, and the edge tries another zone's
    # gateway: calls keep being answered while the zone's Envoy is down and coming back.
    assert len(failed) <= 0.02 * len(outcomes), failed[:3]
    answered = [o.sent_s for o in outcomes if o.ok and o.sent_s >= killed_at]
    gaps = [later - earlier for earlier, later in zip(answered, answered[1:], strict=False)]
    assert max(gaps, default=0.0) < 1.0, (killed_at, back_at, max(gaps))


def test_oip_calls_are_answered_while_a_zone_envoy_is_down_and_back(
    mesh: Mesh, routes: RouteManager
) -> None:
    # As for Predict: a gateway whose zone's Envoy is gone says so on an OIP ModelInfer as
    # well, and the edge tries the call on the other zone's gateway. That gateway must be
    # in the edge's rotation first: a test before may have had zone-b's Envoy down.
    edge = routes.admin_of(EDGE_PROXY)
    wait_until(
        lambda: all(h.healthy for h in edge.clusters()[GATEWAY_CLUSTER].hosts),
        "every gateway in the edge's rotation",
    )
    name = envoy_child("zone-a")
    load = oip_edge_load(mesh)
    load.start()
    try:
        wait_until(lambda: sum(o.ok for o in load.run.window(0.0)) >= 20, "OIP calls answered")
        killed_at, back_at = _kill_and_wait_back(mesh, name, load)
        wait_until(lambda: len(load.run.window(back_at)) >= 40, "a second more")
    finally:
        load.stop()
    assert not load.error
    outcomes = load.snapshot()
    during = [o for o in outcomes if o.sent_s >= killed_at]
    failed = [o for o in during if not o.ok]
    assert len(during) >= 40 and len(failed) <= 0.02 * len(during), failed[:3]


def _served_weights(routes: RouteManager, zone: str) -> dict[str, int]:
    """The fraud split zone's Envoy serves, versions with weight only."""
    split = served_split(routes.admin_of(zone), routes.live_spec(), zone).get("fraud")
    return {v: w for v, w in (split[0] if split else {}).items() if w}


def test_a_zone_envoy_killed_as_a_change_lands_leaves_every_envoy_on_one_split(
    mesh: Mesh, routes: RouteManager
) -> None:
    # Zone-a's Envoy dies just as a weight change starts: the mesh starts it again (from
    # whatever files are in place then), and the change is either confirmed by every Envoy
    # or put back on all of them; never one zone on the new split and one on the old.
    name = envoy_child("zone-a")
    old = mesh.pid(name)
    wanted = {"v1": 30, "v2": 70}
    mesh.kill(name, signal.SIGKILL, revive=True)
    try:
        routes.set_weights("fraud", wanted)
        applied = True
    except ApplyError:
        applied = False
    wait_until(lambda: mesh.is_running(name) and mesh.pid(name) != old, f"{name} again")
    live = {v: w for v, w in routes.live_spec().models["fraud"].traffic.items() if w}
    assert live == (wanted if applied else {v: w for v, w in START.items() if w})
    wait_until(
        lambda: all(_served_weights(routes, zone) == live for zone in ZONES),
        f"every zone's Envoy on {live}",
    )


def test_a_killed_edge_envoy_is_started_again_and_the_edge_answers_again(mesh: Mesh) -> None:
    name = envoy_child(EDGE_PROXY)
    load = edge_load(mesh)
    load.start()
    try:
        wait_until(lambda: any(o.ok for o in load.run.window(0.0)), "the edge answering")
        _, spawned_at = _kill_and_wait_back(mesh, name, load)
        # A new process is not yet a listening one: how long Envoy takes to bind and to pass
        # its first health checks depends on the host's load, so the edge is back from the
        # first call answered after the new process appeared.
        wait_until(lambda: _first_answer(load, spawned_at) is not None, "an answer again")
        back_at = _first_answer(load, spawned_at)
        assert back_at is not None
        wait_until(lambda: len(load.run.window(back_at)) >= 40, "40 calls after it")
    finally:
        load.stop()
    assert not load.error
    # The edge is one Envoy for every zone: while it is down, calls fail (the caller's
    # retry); from its first answer on, every call is answered: no flapping while the rest
    # of its upstreams pass their health checks.
    after = load.run.window(back_at)
    assert all(o.ok for o in after), [o for o in after if not o.ok][:3]


def _first_answer(load: BackgroundLoad, since_s: float) -> float | None:
    """When the first call sent from `since_s` on that was answered was sent."""
    return min((o.sent_s for o in load.run.window(since_s) if o.ok), default=None)


def test_every_envoys_listener_refuses_strangers(mesh: Mesh, tmp_path: Path) -> None:
    # Each zone's mesh listener is its own Envoy's here: every one must hold the line.
    assert_strangers_refused(mesh, tmp_path)


def test_a_rotation_is_served_by_every_envoy(mesh: Mesh) -> None:
    identity = mesh_identity(mesh.spec)
    before = serials(identity)
    rotate_all(mesh)
    after = serials(identity)
    assert all(after[name] != before[name] for name in before)
    # The edge's Envoy and each zone's re-read the same SDS files: each shows the new pair.
    assert_rotation_served(mesh, after)
    # And calls go on through every zone on the new certificates, none failing.
    load = edge_load(mesh)
    load.start()
    try:
        wait_until(
            lambda: zones_answering(load) >= set(ZONES),
            "both zones answering on the new certificates",
        )
    finally:
        load.stop()
    assert not load.error
    assert all(o.ok for o in load.snapshot()), [o for o in load.snapshot() if not o.ok][:3]
