"""No single point of failure, walked: on a mesh of the topology `servemesh up` runs from
the checkout's mesh.yaml (an edge per zone, an Envoy per zone, a replicated feature store
with a replica and a Sentinel per zone, a registry mirror per zone but the registry's), one
process of each kind in turn is SIGKILLed and kept down while a caller configured as
docs/architecture.md says ("Calling the mesh": every edge, round robin, UNAVAILABLE retried)
sends Predicts, then started again. No Predict may fail or be answered with a fallback.

Each kill lasts until the caller has sent `CALLS_PER_KILL` more calls, so a process is down
for several seconds whatever the machine's speed; the steps run one after the other and
the verdict is per step, naming the process whose loss cost a call."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.chaos.load import drill_load
from servemesh.identity import dial_every_edge
from servemesh.launcher import Mesh, envoy_child
from servemesh.load import BackgroundLoad, window_stats
from servemesh.proxy.admin import AdminClient, AdminError, admin_socket_path
from servemesh.spec import registry_mirror_name, zone_edge_proxy
from servemesh.state.credentials import authorization_value, read_edge_credentials
from tests.mesh.test_store_failover import ENTITIES, replicated_spec
from tests.waiting import wait_until

pytestmark = pytest.mark.mesh

RATE = 40.0
CALLS_PER_KILL = 120  # 3 s at RATE


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    # mesh.yaml's topology (its defaults plus a replicated store), on free ports.
    with Mesh.from_spec(replicated_spec(), tmp_path / "state") as running:
        yield running


def the_kinds(mesh: Mesh) -> dict[str, str]:
    """One process of each kind, by what it is."""
    spec = mesh.spec
    assert spec.edges_per_zone and spec.registry_mirror_zones() == ["zone-b"]
    return {
        "the first zone's edge": envoy_child("envoy"),
        "zone-b's edge": envoy_child(zone_edge_proxy("zone-b")),
        "zone-a's Envoy": envoy_child("zone-a"),
        "a gateway": "gateway-zone-a-0",
        "a feature service": "feature-zone-b-0",
        "a model server": "model-fraud-zone-a-0",
        "the registry": "registry-0",
        "zone-b's registry mirror": registry_mirror_name("zone-b"),
        "the feature store's primary": "redis",
        "a feature store replica": "redis-replica-zone-a",
        "a Sentinel": "redis-sentinel-zone-b",
        "the trace store": "tracestore",
    }


def calls_sent(load: BackgroundLoad) -> int:
    return len(load.run.outcomes)


def more_calls(load: BackgroundLoad, count: int, what: str) -> None:
    """Until the load has sent `count` more calls (its clock, not the test's)."""
    target = calls_sent(load) + count
    wait_until(lambda: calls_sent(load) >= target, what, timeout_s=60)


def back_in_rotation(admin: AdminClient, name: str) -> None:
    wait_until(lambda: edge_calls(admin) > 0, f"calls through {name} again")


def edge_calls(admin: AdminClient) -> int:
    """Calls an edge Envoy has taken since it started."""
    try:
        counters = admin.counters("http.edge.downstream_rq_total")
    except AdminError:
        return 0
    return counters.get("http.edge.downstream_rq_total", 0)


def test_killing_any_one_process_loses_no_predict(mesh: Mesh) -> None:
    kinds = the_kinds(mesh)
    edges = {envoy_child(proxy): proxy for proxy in mesh.spec.edge_proxies()}
    running = set(mesh.pids())
    assert set(kinds.values()) <= running, sorted(set(kinds.values()) - running)
    credentials = read_edge_credentials(mesh.state_dir)
    metadata = [("authorization", authorization_value(*credentials))] if credentials else []
    load = drill_load(
        dial_every_edge(mesh.spec), rate_per_s=RATE, entities=ENTITIES, timeout_s=2.0,
        metadata=metadata,
    )  # fmt: skip
    load.start()
    steps: dict[str, dict[str, object]] = {}
    try:
        more_calls(load, CALLS_PER_KILL, "the load under way")
        for what, name in kinds.items():
            began = load.now_s()
            mesh.kill(name)
            more_calls(load, CALLS_PER_KILL, f"calls with {name} down")
            mesh.restart(name, timeout_s=60)
            if name in edges:
                # Back in the caller's rotation before the next kill: a second edge lost
                # while the first is still out would be two failures at once.
                back_in_rotation(AdminClient(admin_socket_path(mesh.state_dir, edges[name])), name)
            more_calls(load, int(RATE), f"calls after {name} is back")
            stats = window_stats(load.run.outcomes, began, load.now_s())
            steps[what] = {
                "process": name,
                "sent": stats.sent,
                "failed": stats.failed,
                "degraded": stats.degraded,
                "codes": stats.codes,
            }
    finally:
        load.stop()
    assert not load.error, load.error
    for what, step in steps.items():  # shown with -s, and in the report on a failure
        print(
            f"{what:30} {step['process']:26} sent {step['sent']:4} failed {step['failed']}"
            f" {step['codes'] if step['failed'] or step['degraded'] else ''}"
        )
    lost = {what: step for what, step in steps.items() if step["failed"] or step["degraded"]}
    assert not lost, lost
    assert all(int(str(step["sent"])) >= CALLS_PER_KILL for step in steps.values()), steps
