"""The container drills through the chaos suite, for real: each of
chaos/experiments/containers-*.yaml run by `servemesh chaos run`'s runner, shortened. Each
drill renders and starts a compose project of its own (deploy/compose/dns.yml on the local
images), drives Predicts through its published edge, injects its fault through the Docker
engine, checks its steady state before and after, runs its rollbacks, writes its report
and journal, and removes the project. Every assertion reads the drill's own journal and
summary.

Marked `containers` (tests/conftest.py); skipped without a Docker engine. The images come
from `make images` (tests/containers/conftest.py builds them once per session).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from servemesh.chaos.runner import DrillResult, run_drill
from tests.containers.drive import engine_missing

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "deploy" / "compose"

pytestmark = pytest.mark.timeout(900)

SHORT: dict[str, Any] = {
    "rate": 50,
    "baseline_s": 5,
    "recover_s": 20,
    "recover_early": True,
    "slo_window_s": 3,
    "tail_s": 0.5,
    # Latency is not what these tests prove: a shared two-core host stalls containers too.
    "p99_tolerance_ms": [0, 2500],
}


@pytest.fixture(autouse=True)
def _engine(monkeypatch: pytest.MonkeyPatch) -> None:
    reason = engine_missing("docker-compose")
    if reason is not None:
        pytest.skip(reason)
    # The drill's paths (the compose file and spec) are relative to a checkout's root.
    monkeypatch.chdir(REPO)


@pytest.fixture(autouse=True)
def _built(_engine: None, images: str) -> None:
    """The drills start compose projects on the local images: built first, whatever order
    the lane's modules run in (a fresh machine has none)."""


def left_behind() -> dict[str, list[str]]:
    """Containers and networks of any compose project of deploy/compose still there."""
    label = f"label=com.docker.compose.project.working_dir={COMPOSE_DIR}"
    found = {}
    for kind, command in {
        "containers": ["docker", "ps", "-a", "-q", "--filter", label],
        "networks": ["docker", "network", "ls", "-q", "--filter", "name=servemesh-drill-"],
    }.items():
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
        found[kind] = done.stdout.split()
    return found


def container_drill(name: str, tmp_path: Path, **variables: Any) -> DrillResult:
    result = run_drill(name, out_dir=tmp_path / "run", variables={**SHORT, **variables})
    assert result.summary, f"no report: {result.text}"
    for key in ("report", "timeline", "summary", "journal"):
        assert Path(result.summary["files"][key]).stat().st_size > 0
    assert left_behind() == {"containers": [], "networks": []}
    print(f"{name}: {result.summary['numbers']}")
    return result


def output(result: DrillResult, name: str) -> Any:
    runs = [r for r in result.journal["run"] if r["activity"]["name"] == name]
    assert runs, f"{name} did not run"
    return runs[0]["output"]


def rolled_back(result: DrillResult) -> list[str]:
    return [r["activity"]["name"] for r in result.journal.get("rollbacks", [])]


def test_a_crashed_model_server_container_is_restarted_and_no_call_fails(
    tmp_path: Path,
) -> None:
    result = container_drill("containers-replica-crash", tmp_path)
    assert result.verdict == "held", result.text
    (crash,) = result.summary["windows"]
    assert crash["label"] == "crash model-fraud-zone-a-0"
    assert crash["failed"] == 0 and crash["sent"] > 50, crash
    back = output(result, "the-engine-starts-it-again")
    assert back["restarts"] >= 1, back
    assert rolled_back(result) == ["it-is-back"]


def test_a_crashed_zone_envoy_container_costs_its_zone_seconds(tmp_path: Path) -> None:
    result = container_drill("containers-zone-proxy-crash", tmp_path)
    assert result.verdict == "held", result.text
    (crash,) = result.summary["windows"]
    # The process mesh's bound (tests/mesh/test_zone_proxies.py): at most 2% fail, each
    # UNAVAILABLE, while the edge moves zone-a's calls to zone-b's gateway.
    assert crash["success_pct"] >= 98, crash
    assert set(crash["codes"]) <= {"UNAVAILABLE"}, crash
    assert output(result, "the-engine-starts-it-again")["restarts"] >= 1
    assert result.summary["phases"]["after faults"]["zones"].get("zone-a", 0) > 10


def test_a_frozen_zone_loses_only_what_it_froze_and_takes_its_share_again(
    tmp_path: Path,
) -> None:
    result = container_drill("containers-zone-outage", tmp_path)
    assert result.verdict == "held", result.text
    (outage,) = result.summary["windows"]
    assert outage["label"] == "zone-a frozen"
    # What the frozen gateway holds is hedged to zone-b's at the edge (the policy asks 98%
    # answered); a call the hedge could not save runs out its deadline, nothing else
    # fails. Once health checks ejected zone-a's gateway, zone-b answers everything.
    assert outage["success_pct"] >= 98, outage
    assert set(outage["codes"]) <= {"DEADLINE_EXCEEDED"}, outage
    assert output(result, "other-zone-share-in-the-fault-pct") == 100.0
    assert result.summary["phases"]["after faults"]["zones"].get("zone-a", 0) > 10
    assert "thaw-zone-a" in rolled_back(result)


def test_with_the_registry_container_stopped_serving_goes_on(tmp_path: Path) -> None:
    result = container_drill("containers-registry-down", tmp_path)
    assert result.verdict == "held", result.text
    (down,) = result.summary["windows"]
    assert down["label"] == "registry-0 stopped"
    assert down["failed"] == 0 and down["sent"] >= 300, down
    assert output(result, "start-the-registry")["started"] == "registry-0"


def test_partitioned_zones_each_serve_on_their_own(tmp_path: Path) -> None:
    result = container_drill("containers-partition", tmp_path)
    assert result.verdict == "held", result.text
    (cut,) = result.summary["windows"]
    assert cut["failed"] == 0 and cut["sent"] >= 300, cut
    # Both zones answered through the partition, each from its own replicas.
    assert set(cut["zones"]) == {"zone-a", "zone-b"}, cut
    # The action checked the cut from inside each zone's Envoy, the heal the same way.
    assert output(result, "partition-the-zones")["cut"] == {"zone-a": "zone-b", "zone-b": "zone-a"}
    assert set(output(result, "join-the-zones")["joined"]) == {"zone-a", "zone-b"}


def test_a_throttled_zone_is_hedged_around_at_the_edge(tmp_path: Path) -> None:
    result = container_drill("containers-brownout", tmp_path)
    assert result.verdict == "held", result.text
    (brownout,) = result.summary["windows"]
    # The edge hedges what zone-a's starved gateway holds to zone-b's (traffic.edge_hedge
    # in the compose spec). What the policy still allows: a call the hedge could not save
    # runs out its deadline, or ends UNAVAILABLE when zone-a's Envoy drops it; nothing else
    # fails, and nothing is answered by a fallback.
    assert brownout["success_pct"] >= 99 and brownout["degraded"] == 0, brownout
    assert set(brownout["codes"]) <= {"DEADLINE_EXCEEDED", "UNAVAILABLE"}, brownout
    assert result.summary["phases"]["after faults"]["failed"] == 0
    assert max(output(result, "zone-a-was-throttled").values()) > 0
    # The edge's least-request balancing gave zone-b more than it had before the brownout.
    before = result.summary["phases"]["baseline"]["zones"].get("zone-b", 0)
    assert brownout["zones"].get("zone-b", 0) > before, (before, brownout["zones"])
