"""`servemesh rollout` against a real mesh under steady load: the real analysis (gateway
metrics, the replicas' shadow ledger), the real checklist and gates, Envoy swapping routes,
and the controller as operators run it, a process of its own (`python -m servemesh`).

One mesh serves the whole module (v1 the baseline, one good and three bad versions); each
test starts from v1 at 100% and leaves it there. Plans are short (1 s dwell, 1 s interval),
so each rollout takes seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from servemesh.chaos.load import drill_load
from servemesh.chaos.mesh import DrillMesh
from servemesh.identity import dial_edge
from servemesh.identity.edge_client import dial_edge_as
from servemesh.load import BackgroundLoad
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_view import live_view
from servemesh.rollout.gates import error_budget_item
from servemesh.spec import DemoSpec, MeshSpec, MetricsSpec, ModelSpec, ModelVersionSpec, Ports
from servemesh.spec.rollout_plan import FreezeSpec, RolloutSpec, SloSpec
from servemesh.state.rollouts import StateStore
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.waiting import wait_until

pytestmark = pytest.mark.mesh

ENTITIES = 1000
RATE = 60
GOOD, ERRORS, SLOW, SHIFTED = "v2", "v3", "v4", "v5"
VERSIONS = {
    "v1": ModelVersionSpec(source="demo:1"),
    GOOD: ModelVersionSpec(source="demo:1"),  # the same model: a good version
    ERRORS: ModelVersionSpec(source="flaky:30:1"),  # fails on 30% of entities
    SLOW: ModelVersionSpec(source="demo:1", inject_latency_ms=100),  # 100 ms slower
    SHIFTED: ModelVersionSpec(source="shifted:0.3:1"),  # every score moved by +0.3
}

# Short steps. The canary's steps start at 25%: sticky assignment gives a 1% canary 1% of
# the entities, too few for a score distribution to compare in a second of traffic.
PLAN: dict[str, Any] = {
    "steps": [
        {"weight": None, "dwell": "1s", "min_requests": 20},
        {"weight": 25, "dwell": "1s", "min_requests": 10},
        {"weight": 50, "dwell": "1s", "min_requests": 20},
        {"weight": 100, "dwell": "1s", "min_requests": 20},
    ],
    "analysis": {
        "interval": "1s",
        "min_samples": 20,
        "max_error_ratio_increase_points": 1.0,
        "max_p99_ratio": 1.5,
        "p99_slack_ms": 50,
        "max_psi": 0.5,
    },
    "deadline": "10m",
}


# The mesh is frozen (a holiday around today): every rollout here overrides the freeze,
# with a reason, except the one that proves a freeze refuses. An SLO gives the model an
# error budget, which the last test spends.
TODAY = datetime.now(UTC).date()
FROZEN = [str(TODAY + timedelta(days=d)) for d in (-1, 0, 1)]
OVERRIDE = ["--override", "freeze", "--reason", "the test mesh is frozen on purpose"]
SLO = SloSpec(availability=0.99, p99_ms=5000, window="1h")


def rollout_spec(state_dir: Path) -> MeshSpec:
    return MeshSpec(
        ports=Ports.free(),
        state_dir=str(state_dir),
        models={
            "fraud": ModelSpec(
                versions=VERSIONS, traffic={v: 100 if v == "v1" else 0 for v in VERSIONS}
            )
        },
        demo=DemoSpec(enabled=True, entities=ENTITIES),
        # A fast scrape: the budget's windows floor at four scrapes.
        metrics=MetricsSpec(scrape_interval_s=1.0),
        rollout=RolloutSpec(
            slos={"fraud": SLO}, freeze=FreezeSpec(holidays=FROZEN, timezone="UTC")
        ),
    )


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillMesh]:
    state_dir = tmp_path_factory.mktemp("rollout-mesh")
    with DrillMesh.from_spec(rollout_spec(state_dir)) as running:
        yield running


@pytest.fixture
def load(mesh: DrillMesh) -> Iterator[BackgroundLoad]:
    """Steady load through the edge for the test; v1 at 100% again after it."""
    # A 5 s deadline: these tests count the calls a rollout loses, not a busy shared
    # machine's stalls.
    background = drill_load(dial_edge(mesh.spec), rate_per_s=RATE, entities=ENTITIES, timeout_s=5.0)
    background.start()
    try:
        yield background
    finally:
        background.stop()
        routes = RouteManager(mesh.paths)
        live = routes.live_spec().models["fraud"]
        if live.shadow is not None:
            routes.set_shadow("fraud", None)
        if live.traffic.get("v1") != 100:
            routes.set_weights("fraud", {"v1": 100})


# Where a good version must pass: on a shared 2-core machine a second of gateway latency
# right after a route swap can show a p99 of a few hundred milliseconds in either arm, and
# at 100% the canary is compared with the baseline's window of the step before. Latency is
# what the slow version's test proves (at the shadow step, from the replicas' own times).
CALM = {"max_p99_ratio": 5, "p99_slack_ms": 2000}


def plan_file(tmp_path: Path, **analysis: Any) -> Path:
    plan = {**PLAN, "analysis": {**PLAN["analysis"], **analysis}}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def rollout_argv(mesh: DrillMesh, *args: str) -> list[str]:
    return [sys.executable, "-m", "servemesh", "rollout", "--state-dir", str(mesh.state_dir), *args]


def rollout(
    mesh: DrillMesh, *args: str, timeout_s: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        rollout_argv(mesh, *args), capture_output=True, text=True, timeout=timeout_s
    )


def failed_calls(load: BackgroundLoad) -> list[str]:
    return [f"{o.code} at {o.sent_s:.2f}s" for o in load.run.snapshot() if not o.ok]


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def test_a_good_version_goes_from_shadow_to_full_with_no_failed_call(
    mesh: DrillMesh, load: BackgroundLoad, tmp_path: Path
) -> None:
    result = rollout(
        mesh, "start", "fraud", GOOD, "--plan", str(plan_file(tmp_path, **CALM)), *OVERRIDE
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert last_line(result).startswith("promoted: v2 takes 100% of fraud")
    for label in ("shadow", "25%", "50%", "100%"):
        assert f"step {label} passed" in result.stdout, result.stdout
    # The checklist, before any step: every item passed but the freeze, overridden.
    checklist = " ".join(result.stdout.split())
    for item in ("artifact_integrity", "rollback_target", "error_budget"):
        assert f"✓ {item}" in checklist, result.stdout
    assert "! freeze" in checklist and "overridden: the test mesh is frozen on purpose" in checklist
    (override,) = [
        e
        for e in StateStore(mesh.state_dir).history("fraud")
        if e["event"] == "override" and e["version"] == GOOD
    ]
    assert override["item"] == "freeze"
    assert override["reason"] == "the test mesh is frozen on purpose"
    live = RouteManager(mesh.paths).live_spec().models["fraud"]
    assert live.traffic[GOOD] == 100 and live.shadow is None
    assert "v1" in live.versions  # kept for a later rollback
    status = json.loads(rollout(mesh, "status", "fraud", "--json").stdout)
    assert status["status"] == "promoted" and status["controller_alive"] is False
    assert failed_calls(load) == []


@pytest.mark.parametrize(
    ("version", "check"),
    [(ERRORS, "error_ratio"), (SLOW, "p99"), (SHIFTED, "psi")],
    ids=["errors-on-30pct-of-entities", "100ms-slower", "scores-shifted"],
)
def test_a_bad_version_is_rolled_back_at_its_first_bad_step(
    mesh: DrillMesh, load: BackgroundLoad, tmp_path: Path, version: str, check: str
) -> None:
    result = rollout(mesh, "start", "fraud", version, "--plan", str(plan_file(tmp_path)), *OVERRIDE)
    assert result.returncode == 3, result.stdout + result.stderr
    reason = last_line(result)
    assert reason.startswith(f"rolled back: step shadow: {check} fail"), result.stdout
    # The first judgement of the step it failed: the rollback came one interval after the
    # step had enough calls to judge (each judgement prints one line per check; a busy
    # machine may first print "wait" lines while too few calls have arrived).
    judged = [line for line in result.stdout.splitlines() if f"shadow {check} " in line]
    waited = [line for line in judged if f"shadow {check} wait:" in line]
    decided = [line for line in judged if line not in waited]
    assert len(decided) == 1 and f"shadow {check} fail:" in decided[0], result.stdout
    events = StateStore(mesh.state_dir).history("fraud")
    mine = [e for e in events if e["version"] == version]
    step = next(e for e in mine if e["event"] == "step")
    back = next(e for e in mine if e["event"] == "rolling back")
    # One interval per judgement (the waits and the failing one), plus reading the counters.
    assert back["at"] - step["at"] < (len(waited) + 1) * 1.0 + 3.0
    live = RouteManager(mesh.paths).live_spec().models["fraud"]
    assert live.traffic["v1"] == 100 and live.shadow is None
    # The canary only ever got shadow copies: callers saw none of its answers.
    assert failed_calls(load) == []


def test_a_killed_controller_is_resumed_and_finishes_with_no_failed_call(
    mesh: DrillMesh, load: BackgroundLoad, tmp_path: Path
) -> None:
    plan = plan_file(tmp_path, **CALM)
    controller = subprocess.Popen(
        rollout_argv(mesh, "start", "fraud", GOOD, "--plan", str(plan), *OVERRIDE),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    store = StateStore(mesh.state_dir)
    try:

        def at_half() -> bool:
            state = store.load("fraud")
            return (
                state is not None
                and state.version == GOOD
                and state.step_label == "50%"
                and state.step_applied
            )

        wait_until(at_half, "Envoy to serve the rollout's 50% step", timeout_s=120)
        os.kill(controller.pid, signal.SIGKILL)
        controller.wait(timeout=10)
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait(timeout=10)
    assert controller.stdout is not None
    controller.stdout.close()
    wait_until(lambda: not store.alive("fraud"), "the kernel to drop the dead controller's lock")
    status = json.loads(rollout(mesh, "status", "fraud", "--json").stdout)
    assert status["status"] == "running" and status["controller_alive"] is False
    assert status["step"] == "50%" and status["weights"] == {"v1": 50, GOOD: 50}
    # Nobody drives it: Envoy keeps serving what the dead controller last set.
    live = RouteManager(mesh.paths).live_spec().models["fraud"]
    assert live.traffic["v1"] == 50 and live.traffic[GOOD] == 50
    started = time.monotonic()
    result = rollout(mesh, "resume", "fraud")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "continues at step 50%" in result.stdout
    assert last_line(result).startswith("promoted:")
    assert time.monotonic() - started < 60
    live = RouteManager(mesh.paths).live_spec().models["fraud"]
    assert live.traffic[GOOD] == 100
    assert failed_calls(load) == []


def routes_now(mesh: DrillMesh) -> tuple[int, list[tuple[str, int, bool]]]:
    """The route history's length and what Envoy serves (weights, shadows)."""
    manager = RouteManager(mesh.paths)
    live = manager.live_spec()
    rows = live_view(manager.admins(live), live)
    return len(manager.history()), [(r.version, r.weight, r.shadow) for r in rows]


def test_a_rollout_in_a_freeze_is_refused_and_leaves_the_routes_untouched(
    mesh: DrillMesh, tmp_path: Path
) -> None:
    before = routes_now(mesh)
    result = rollout(mesh, "start", "fraud", GOOD, "--plan", str(plan_file(tmp_path)))
    assert result.returncode == 4, result.stdout + result.stderr
    assert last_line(result).startswith("refused: refused by the checklist: freeze: "), (
        result.stdout
    )
    assert "✗ freeze" in " ".join(result.stdout.split())
    assert routes_now(mesh) == before
    status = json.loads(rollout(mesh, "status", "fraud", "--json").stdout)
    assert (status["version"], status["status"]) == (GOOD, "refused")


def cli(mesh: DrillMesh, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "servemesh", *args, "--state-dir", str(mesh.state_dir)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_every_change_path_is_held_by_the_freeze_and_the_way_back_is_not(
    mesh: DrillMesh, tmp_path: Path
) -> None:
    """What a frozen rollout cannot do, no command does by hand: `routes set`, `apply`
    moving weights and `models alias` are refused (exit 4, the freeze named) and change
    nothing; with `--override freeze --reason` the change goes ahead and is recorded; the
    way back (the baseline's weight restored) is never refused, and a rollback that undoes
    it is refused as the deploy it is."""
    before = routes_now(mesh)
    moved = tmp_path / "moved.yaml"
    moved.write_text(yaml.safe_dump({"models": {"fraud": {"traffic": {"v1": 90, GOOD: 10}}}}))
    for args in (
        ("routes", "set", "fraud", "v1=90", f"{GOOD}=10"),
        ("apply", str(moved)),
        ("models", "alias", "fraud", "production", GOOD),
    ):
        refused = cli(mesh, *args)
        assert refused.returncode == 4, (args, refused.stdout, refused.stderr)
        assert "freeze: inside " in refused.stderr, refused.stderr
        assert "--override freeze --reason" in refused.stderr, refused.stderr
        assert routes_now(mesh) == before, args
    # Nothing was recorded for refusals; a dry run plans without asking the gates.
    assert not (mesh.state_dir / "gate-overrides.jsonl").exists()
    assert cli(mesh, "apply", str(moved), "--dry-run").returncode == 0

    overridden = cli(mesh, "routes", "set", "fraud", "v1=90", f"{GOOD}=10", *OVERRIDE)
    assert overridden.returncode == 0, overridden.stdout + overridden.stderr
    assert "gate overridden: freeze: inside " in overridden.stderr, overridden.stderr
    weights = {version: weight for version, weight, _ in routes_now(mesh)[1]}
    assert (weights["v1"], weights[GOOD]) == (90, 10)
    [record] = [
        json.loads(line)
        for line in (mesh.state_dir / "gate-overrides.jsonl").read_text().splitlines()
    ]
    assert record["command"] == "routes set fraud" and record["models"] == ["fraud"]
    assert [(g["gate"], g["reason"]) for g in record["gates"]] == [
        ("freeze", "the test mesh is frozen on purpose")
    ]
    history = RouteManager(mesh.paths).history()
    assert "gates overridden: freeze: the test mesh is frozen on purpose" in str(history[-1])

    # The way back (the canary's share to the version serving the most) is not a deploy.
    back = cli(mesh, "routes", "set", "fraud", "v1=100", f"{GOOD}=0")
    assert back.returncode == 0, back.stdout + back.stderr
    assert routes_now(mesh)[1] == before[1]
    # Undoing that way back would put the canary's share back: refused like the first move.
    again = cli(mesh, "routes", "rollback")
    assert again.returncode == 4 and "freeze: inside " in again.stderr, again.stderr
    assert routes_now(mesh)[1] == before[1]


def predict(edge: gateway_pb2_grpc.GatewayStub, entity: str, version: str) -> bool:
    try:
        edge.Predict(
            gateway_pb2.PredictRequest(model="fraud", entity_ids=[entity], version=version),
            timeout=5,
        )
    except grpc.RpcError:
        return False
    return True


# Last in the module: the budget stays spent.
def test_a_rollout_with_the_budget_spent_is_refused_and_leaves_the_routes_untouched(
    mesh: DrillMesh, tmp_path: Path
) -> None:
    with dial_edge_as(mesh.spec, mesh.spec.edge_address).channel() as channel:
        edge = gateway_pb2_grpc.GatewayStub(channel)

        def spent() -> bool:
            # Calls pinned to the build that fails 30% of entities spend the budget (1% of
            # calls) many times over, until the gate's source has seen them.
            for index in range(100):
                predict(edge, f"user-{index}", ERRORS)
            # Spent, not only burning fast: a fast burn refuses first, with its own reason,
            # while a mesh that served many calls before still has budget left.
            item = error_budget_item(RouteManager(mesh.paths).live_spec(), "fraud")
            return item.detail.startswith("budget spent")

        wait_until(spent, "the error budget to be spent", timeout_s=120, every_s=0.2)
    before = routes_now(mesh)
    result = rollout(mesh, "start", "fraud", GOOD, "--plan", str(plan_file(tmp_path)), *OVERRIDE)
    assert result.returncode == 4, result.stdout + result.stderr
    reason = last_line(result)
    assert reason.startswith("refused: refused by the checklist: error_budget: budget spent"), (
        result.stdout
    )
    assert "✗ error_budget" in " ".join(result.stdout.split())
    assert routes_now(mesh) == before
