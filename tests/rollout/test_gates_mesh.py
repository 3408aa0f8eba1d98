"""The checklist and gates against a real mesh (registry, Envoy, gateways, and the mesh's
Prometheus with the SLO rules rendered from its spec): a healthy version passes the items
that need no traffic, a damaged artifact and a missing metric fail, and a budget spent by
failed predictions through the edge refuses the rollout, read from Prometheus and from the
gateways' counters alike, leaving the routes as they were.

One mesh for the module: fraud v1 (the baseline, all traffic) and v2, the bad-canary
drill's defective build (`flaky:30`: 30% of entities fail), pinned by the test's calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from servemesh.chaos.mesh import DrillMesh
from servemesh.cli import main
from servemesh.identity import dial_registry
from servemesh.identity.edge_client import dial_edge_as
from servemesh.launcher import Mesh
from servemesh.observe.alert_receiver import read_received
from servemesh.observe.prom_query import PromClient
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_view import live_view
from servemesh.rollout.gates import error_budget_item, preflight
from servemesh.rollout.types import ChecklistItem
from servemesh.slo_rules import BUDGET_LEFT, BURN_RATE, burn_windows
from servemesh.spec import (
    DemoSpec,
    MeshSpec,
    MetricsSpec,
    ModelSpec,
    ModelVersionSpec,
    Ports,
    ResolvedSpec,
)
from servemesh.spec.rollout_plan import (
    ChecklistSpec,
    FreezeSpec,
    FreezeWindow,
    RolloutPlan,
    RolloutSpec,
    SloSpec,
)
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc
from tests.registry.registry_kit import blob_path, corrupt
from tests.waiting import wait_until

pytestmark = pytest.mark.mesh

REPO = Path(__file__).resolve().parents[2]

ENTITIES = 100
SLO = SloSpec(availability=0.99, p99_ms=2000, window="1h")
FREEZE = FreezeSpec(
    timezone="Europe/Berlin",
    weekly=[FreezeWindow(start="fri 15:00", end="mon 09:00", reason="weekend freeze")],
)
WEDNESDAY = datetime(2026, 12, 9, 10, 0, tzinfo=UTC)
SATURDAY = datetime(2026, 12, 5, 10, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(
        ports=Ports.free(),
        state_dir=str(tmp_path_factory.mktemp("gates-mesh")),
        models={
            "fraud": ModelSpec(
                versions={
                    "v1": ModelVersionSpec(source="demo:1"),
                    "v2": ModelVersionSpec(source="flaky:30"),
                },
                traffic={"v1": 100, "v2": 0},
            )
        },
        demo=DemoSpec(enabled=True, entities=ENTITIES),
        # A fast scrape: the budget's windows floor at four scrapes.
        metrics=MetricsSpec(scrape_interval_s=1.0),
        rollout=RolloutSpec(slos={"fraud": SLO}, freeze=FREEZE),
    )
    with DrillMesh.from_spec(spec) as running:
        yield running


def _routes(mesh: Mesh) -> tuple[int, list[tuple[str, int, bool]]]:
    """The route history's length and the weights Envoy serves."""
    manager = RouteManager(mesh.paths)
    rows = live_view(manager.admins(mesh.spec), mesh.spec)
    return len(manager.history()), [(r.version, r.weight, r.shadow) for r in rows]


def _by_name(items: Iterable[ChecklistItem]) -> dict[str, ChecklistItem]:
    return {item.name: item for item in items}


def test_a_healthy_version_passes_and_a_missing_metric_fails_naming_it(mesh: Mesh) -> None:
    plan = RolloutPlan(checklist=ChecklistSpec(offline_metrics={"auc": ">=0.8"}))
    items = _by_name(preflight(mesh.spec, "fraud", "v2", plan, now=WEDNESDAY, overrides={}))
    assert list(items) == [
        "artifact_integrity",
        "offline_metrics",
        "rollback_target",
        "freeze",
        "error_budget",
    ]
    integrity = items["artifact_integrity"]
    assert integrity.ok, integrity.detail
    assert integrity.detail.startswith("fraud/v2 sha256 ")
    assert "verified over" in integrity.detail
    # The seeded build records no metrics: the plan's auc is missing, named.
    metrics = items["offline_metrics"]
    assert not metrics.ok and metrics.blocks
    assert metrics.detail == "auc missing from fraud/v2's metrics (it has: none)"
    rollback = items["rollback_target"]
    assert rollback.ok, rollback.detail
    assert rollback.detail.startswith("fraud v1 (weight 100) healthy on 2 of 2 hosts")
    assert items["freeze"].ok
    # An overridden item is marked, with its reason.
    [*_, marked] = [
        i
        for i in preflight(
            mesh.spec, "fraud", "v2", plan, now=WEDNESDAY, overrides={"offline_metrics": "INC-7"}
        )
        if i.name == "offline_metrics"
    ]
    assert marked.override_reason == "INC-7" and not marked.ok and not marked.blocks


def test_a_version_unknown_to_the_registry_and_a_freeze_fail(mesh: Mesh) -> None:
    before = _routes(mesh)
    items = _by_name(preflight(mesh.spec, "fraud", "v9", RolloutPlan(), now=SATURDAY, overrides={}))
    assert not items["artifact_integrity"].ok
    assert "no record of fraud/v9" in items["artifact_integrity"].detail
    assert "NOT_FOUND" in items["artifact_integrity"].detail
    freeze = items["freeze"]
    assert not freeze.ok
    assert freeze.detail.startswith(
        "inside weekend freeze (fri 15:00 -> mon 09:00 Europe/Berlin) until Mon 2026-12-07 09:00"
    )
    assert _routes(mesh) == before  # the gates only read


async def test_preflight_works_from_a_caller_with_its_own_event_loop(mesh: Mesh) -> None:
    items = preflight(mesh.spec, "fraud", "v1", RolloutPlan(), now=WEDNESDAY, overrides={})
    integrity = _by_name(items)["artifact_integrity"]
    assert integrity.ok and integrity.detail.startswith("fraud/v1 sha256 ")


def _record(spec: ResolvedSpec, version: str) -> registry_pb2.ModelVersion:
    with dial_registry(spec).channel() as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        return stub.GetVersion(registry_pb2.GetVersionRequest(model="fraud", version=version))


def test_an_artifact_damaged_in_the_store_fails_its_integrity_check(mesh: Mesh) -> None:
    record = _record(mesh.spec, "v2")
    # The registry's own copy (a zone's mirror holds another, in a store of its own).
    store = mesh.spec.registry_store_dir
    [blob] = list(store.rglob(f"blobs/sha256/{record.sha256[:2]}/{record.sha256}"))
    assert blob == blob_path(blob.parents[2].parent, record.sha256)
    original = blob.read_bytes()
    corrupt(blob)
    try:
        items = _by_name(
            preflight(mesh.spec, "fraud", "v2", RolloutPlan(), now=WEDNESDAY, overrides={})
        )
    finally:
        blob.write_bytes(original)
        blob.chmod(0o444)
    integrity = items["artifact_integrity"]
    assert not integrity.ok
    assert f"does not match the record's {record.sha256}" in integrity.detail


def _predict(edge: gateway_pb2_grpc.GatewayStub, entity: str, version: str) -> bool:
    try:
        edge.Predict(
            gateway_pb2.PredictRequest(model="fraud", entity_ids=[entity], version=version),
            timeout=5,
        )
    except grpc.RpcError:
        return False
    return True


def test_a_spent_budget_refuses_from_prometheus_and_from_the_gateways_counters(
    mesh: Mesh, tmp_path: Path
) -> None:
    if mesh.endpoints().get("prometheus") is None:
        pytest.skip("no prometheus binary here (Debian package `prometheus`)")
    client = PromClient(str(mesh.endpoints()["prometheus"]))
    before = _routes(mesh)
    with dial_edge_as(mesh.spec, mesh.spec.edge_address).channel() as channel:
        edge = gateway_pb2_grpc.GatewayStub(channel)
        # Good traffic only: the budget is whole, read from Prometheus.
        for index in range(20):
            assert _predict(edge, f"user-{index}", "v1")
        kept = error_budget_item(mesh.spec, "fraud")
        assert kept.ok, kept.detail
        assert "over the last 1h" in kept.detail

        failures = 0

        def spent() -> str | None:
            # The defective build fails 30% of entities: each round spends the budget
            # (1% of calls) many times over, until Prometheus has scraped it.
            nonlocal failures
            for index in range(ENTITIES):
                failures += not _predict(edge, f"user-{index}", "v2")
            item = error_budget_item(mesh.spec, "fraud")
            # The fast burn can refuse a scrape or two before the budget's own rule has
            # counted the new version's first failures: this waits for the refusal for
            # the spent budget, which also names the burn.
            return item.detail if item.detail.startswith("budget spent:") else None

        detail = wait_until(
            spent, "the error budget gate to refuse: spent", timeout_s=90, every_s=0.2
        )

        # The recording rules rendered from the spec say the same in Prometheus. The burn
        # windows are seconds long: calls keep coming so that each one holds some.
        def recorded() -> tuple[list[float], set[str]] | None:
            for index in range(20):
                _predict(edge, f"user-{index}", "v2")
            budget = client.query(f'{BUDGET_LEFT}{{model="fraud",objective="availability"}}')
            burn = client.query(f'{BURN_RATE}{{model="fraud",objective="availability"}}')
            windows = {labels["window"] for labels, _ in burn}
            return (
                ([value for _, value in budget], windows) if budget and len(windows) == 3 else None
            )

        budget_left, burn_windows_seen = wait_until(
            recorded, "the budget and burn rules recorded", timeout_s=60, every_s=0.2
        )
    assert failures >= 30
    assert detail.startswith("budget spent: budget left -")
    assert "over the last 1h (availability -" in detail
    assert "failed or degraded of" in detail and "allowed at 99%" in detail
    fast, slow = burn_windows(SLO.window_s, mesh.spec.metrics.scrape_interval_s)
    # 1h/720 = 5 s; its short twelfth floored at four 1 s scrapes.
    assert (fast.short, fast.long, slow.short, slow.long) == ("4s", "5s", "4s", "30s")
    assert "fast burn over 4s/5s (limit 14.4): availability " in detail
    assert budget_left and all(value < 0 for value in budget_left)
    assert burn_windows_seen == {"4s", "5s", "30s"}

    # Without Prometheus (a state dir that names none), the gateways' counters since
    # start say the same, and the detail says where the numbers came from.
    elsewhere = tmp_path / "no-prometheus"
    elsewhere.mkdir()
    (elsewhere / "endpoints.json").write_text(json.dumps({"prometheus": None}))
    counters = error_budget_item(
        mesh.spec.model_copy(update={"state_dir": str(elsewhere)}), "fraud"
    )
    assert not counters.ok
    assert counters.detail.startswith("budget spent: budget left -")
    assert "from the gateways' counters since start (" in counters.detail
    assert "Prometheus is not running" in counters.detail
    assert "burn since start: availability " in counters.detail
    # A Prometheus named but silent: the counters again, saying why.
    (elsewhere / "endpoints.json").write_text(json.dumps({"prometheus": "127.0.0.1:1"}))
    silent = error_budget_item(mesh.spec.model_copy(update={"state_dir": str(elsewhere)}), "fraud")
    assert not silent.ok
    assert "since start" in silent.detail
    assert "Prometheus at 127.0.0.1:1 did not answer (" in silent.detail
    assert _routes(mesh) == before  # refused by reading, nothing changed


# After the budget test: its failed calls are what burns the budget here.
def test_the_fast_burn_pages_through_alertmanager_then_resolves(mesh: Mesh) -> None:
    """The SLO's multi-window alerts, end to end: calls failing at 30% burn fraud's
    availability budget past the fast condition (14.4x over 5 s and 4 s here), Prometheus
    fires ServemeshSLOFastBurn, Alertmanager routes it by severity to the mesh's receiver
    (labels and runbook with it), `servemesh alerts` lists it firing, and once the failures
    stop it resolves and the receiver is told that too."""
    endpoints = mesh.endpoints()
    if endpoints.get("alertmanager") is None:
        pytest.skip("no alertmanager binary here (Debian package `prometheus-alertmanager`)")

    def received(status: str) -> dict[str, Any] | None:
        for sent in read_received(mesh.state_dir):
            labels = sent["labels"]
            if (
                sent["status"] == status
                and labels.get("alertname") == "ServemeshSLOFastBurn"
                and labels.get("objective") == "availability"
            ):
                return sent
        return None

    with dial_edge_as(mesh.spec, mesh.spec.edge_address).channel() as channel:
        edge = gateway_pb2_grpc.GatewayStub(channel)

        def paged() -> dict[str, Any] | None:
            for index in range(20):
                _predict(edge, f"user-{index}", "v2")
            return received("firing")

        page = wait_until(paged, "the fast burn at the receiver", timeout_s=90, every_s=0.2)
        listed = main(["alerts", "--state-dir", str(mesh.state_dir), "-o", "json"])
    assert page["route"] == "page"
    assert page["labels"]["severity"] == "page" and page["labels"]["model"] == "fraud"
    assert page["annotations"]["runbook"] == "docs/runbooks/slo-burn.md"
    assert (REPO / page["annotations"]["runbook"]).exists()
    assert listed == 0
    # The failures stopped: the short window empties within seconds, and the receiver
    # hears the alert resolve.
    resolved = wait_until(lambda: received("resolved"), "the fast burn resolved", timeout_s=90)
    assert resolved["fingerprint"] == page["fingerprint"]
