"""`servemesh bench compose` without an engine: the processes' spec it derives from the compose
file, the ratios it pairs by repeat, and the goals it reports (the run itself needs a Docker
engine and the images; its numbers are in docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

from servemesh.bench.compose import COMPOSE_SPEC, as_report, ratio_rows, up_spec
from servemesh.bench.predict import Round
from servemesh.spec import load_spec, resolve


def test_the_up_mesh_has_the_compose_shape_on_loopback(tmp_path: Path) -> None:
    compose = load_spec(str(COMPOSE_SPEC))
    local = up_spec(compose, tmp_path)
    assert local.zones == compose.zones
    assert local.proxy.layout == compose.proxy.layout == "per_zone"
    assert (local.gateway, local.feature, local.model_servers) == (
        compose.gateway,
        compose.feature,
        compose.model_servers,
    )
    # No Prometheus in either; both trace into the mesh's own store (a container there,
    # the launcher's process here: the up mesh names no collector).
    assert local.metrics.prometheus == "off"
    assert local.tracing.enabled and compose.tracing.enabled and not local.tracing.otlp_endpoint
    assert resolve(local).embedded_trace_store_port is not None
    # Nothing of the containers' world: the file catalog, the launcher's Redis, loopback.
    assert local.discovery.backend == "file" and not local.discovery.hosts
    assert local.feature_store.redis_url is None
    resolved = resolve(local)
    assert resolved.state_dir == str(tmp_path)
    assert {i.name for i in resolved.instances()} == {i.name for i in resolve(compose).instances()}


def rounds(
    up: list[tuple[float, float]], compose: list[tuple[float, float]], c: int
) -> list[Round]:
    found = []
    for arm, values in (("up", up), ("compose", compose)):
        for repeat, (rps, p50) in enumerate(values):
            found.append(Round(arm, c, repeat, rps=rps, p50_ms=p50, p99_ms=p50 * 3, errors=0))
    return found


def test_ratios_are_compose_over_up_per_repeat() -> None:
    found = rounds([(1000, 2.0), (800, 4.0)], [(900, 2.5), (800, 4.0)], 64)
    row = ratio_rows(found, [64])["64"]
    assert isinstance(row, dict)
    assert row["rps_ratio"] == [0.9, 1.0]
    assert row["p50_ratio"] == [1.25, 1.0]
    assert row["arms"]["up"]["rps"] == {"median": 900.0, "min": 800, "max": 1000}


def test_the_report_says_which_goals_are_met_and_fails_on_a_failed_call() -> None:
    found = rounds([(500, 1.0)] * 3, [(450, 2.0)] * 3, 1)
    found += rounds([(3000, 20.0)] * 3, [(2100, 30.0)] * 3, 64)
    payload = {
        "repeats": 3,
        "seconds": 5.0,
        "compose_up_s": 30.0,
        "by_concurrency": ratio_rows(found, [1, 64]),
    }
    report = as_report(payload)
    goals = next(t for t in report.tables if t.title == "goals, same run")
    assert goals.rows == [
        ("c=64 req/s compose/up", "0.70x", ">= 0.8", "no"),
        ("c=1 p50 compose/up", "2.00x", "<= 1.5", "no"),
    ]
    assert report.status == 0
    failing = [r if r.target == "up" else Round(**{**vars(r), "errors": 2}) for r in found]
    payload["by_concurrency"] = ratio_rows(failing, [1, 64])
    assert as_report(payload).status == 1
