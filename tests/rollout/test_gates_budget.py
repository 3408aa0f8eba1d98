"""The error budget's arithmetic: burn-rate windows scaled to an SLO's window, the
recording rules a spec with SLOs renders (promtool checks them), counts from the gateways'
counters, and the line the gate prints."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import yaml

from servemesh.observe.scrape import parse
from servemesh.procs.prometheus import PrometheusServer, promtool_binary
from servemesh.procs.supervisor import Supervisor
from servemesh.rollout.budget import (
    BudgetReading,
    ObjectiveBudget,
    count_from_samples,
)
from servemesh.slo_rules import BUDGET_LEFT, BURN_RATE, burn_windows, render_rules, slow_bound_s
from servemesh.spec import MeshSpec, Ports, ResolvedSpec, resolve
from servemesh.spec.rollout_plan import RolloutSpec, SloSpec

PROMTOOL = promtool_binary()


def test_the_windows_are_the_sre_workbook_ones_for_a_30_day_slo() -> None:
    fast, slow = burn_windows(30 * 86400, 2.0)
    assert (fast.short, fast.long) == ("300s", "3600s") and fast.threshold == pytest.approx(14.4)
    assert (slow.short, slow.long) == ("1800s", "21600s") and slow.threshold == pytest.approx(6.0)


def test_short_slo_windows_are_floored_at_four_scrapes_and_lower_their_threshold() -> None:
    # A 1 h SLO: the fast windows would be 5 s and 0.4 s; a 2 s scrape needs 8 s.
    fast, slow = burn_windows(3600, 2.0)
    assert (fast.short, fast.long) == ("8s", "8s")
    assert fast.threshold == pytest.approx(0.02 * 3600 / 8)  # 2% of the budget in 8 s
    assert (slow.short, slow.long) == ("8s", "30s")
    assert slow.threshold == pytest.approx(6.0)
    # Never below 1: a burn under 1 keeps the budget.
    assert burn_windows(60, 2.0)[0].threshold == 1.0


def test_the_slow_bound_rounds_the_p99_objective_up_to_a_bucket() -> None:
    assert slow_bound_s(250) == 0.25
    assert slow_bound_s(200) == 0.25  # between 0.1 and 0.25: a call of 220 ms is "fast"
    assert slow_bound_s(0.5) == 0.0005
    assert math.isinf(slow_bound_s(60_000))


def _spec(tmp_path: Path, slos: dict[str, SloSpec]) -> ResolvedSpec:
    return resolve(
        MeshSpec(
            ports=Ports.free(),
            state_dir=str(tmp_path),
            rollout=RolloutSpec(slos=slos),
        )
    )


def test_a_spec_with_slos_renders_burn_rate_and_budget_rules_per_model(tmp_path: Path) -> None:
    spec = _spec(tmp_path, {"fraud": SloSpec(availability=0.99, p99_ms=100, window="30d")})
    groups = render_rules(spec)["groups"]
    assert [g["name"] for g in groups] == [
        "servemesh-sli",
        "servemesh-slo",
        "servemesh-cost",
        "servemesh-drift",
        "servemesh-host",
    ]
    rules = [r for r in groups[1]["rules"] if "record" in r]
    burns = {
        (r["labels"]["objective"], r["labels"]["window"]) for r in rules if r["record"] == BURN_RATE
    }
    windows = {"300s", "3600s", "1800s", "21600s"}
    assert burns == {(o, w) for o in ("availability", "latency") for w in windows}
    budgets = [r for r in rules if r["record"] == BUDGET_LEFT]
    assert [(r["labels"]["objective"], r["labels"]["window"]) for r in budgets] == [
        ("availability", "2592000s"),
        ("latency", "2592000s"),
    ]
    availability = next(r for r in rules if r["labels"] == budgets[0]["labels"])
    # Failed and degraded calls spend it; the allowed share is 1 - availability.
    assert 'code=~"UNAVAILABLE|' in availability["expr"]
    assert 'degraded="true"' in availability["expr"]
    assert availability["expr"].endswith("/ 0.010000000000000009)")
    latency = budgets[1]["expr"]
    assert 'le=~"0\\\\.1"' in latency and latency.endswith("/ 0.01)")
    # The SRE workbook's multi-window alerts: per objective, a page for the fast burn
    # (14.4x over 1 h and 5 m of a 30-day SLO) and a ticket for the slow (6x over 6 h, 30 m).
    alerts = [r for r in groups[1]["rules"] if "alert" in r]
    shapes = {
        (a["alert"], a["labels"]["severity"], a["labels"]["objective"], a["expr"]) for a in alerts
    }
    for objective in ("availability", "latency"):
        where = f'model="fraud",objective="{objective}"'
        for name, severity, threshold, long, short in (
            ("ServemeshSLOFastBurn", "page", "14.4", "3600s", "300s"),
            ("ServemeshSLOSlowBurn", "ticket", "6.0", "21600s", "1800s"),
        ):
            expr = (
                f'{BURN_RATE}{{{where},window="{long}"}} > {threshold} and ignoring(window) '
                f'{BURN_RATE}{{{where},window="{short}"}} > {threshold}'
            )
            assert (name, severity, objective, expr) in shapes, (name, objective, shapes)
    assert len(alerts) == 4
    assert {a["annotations"]["runbook"] for a in alerts} == {"docs/runbooks/slo-burn.md"}
    # Without SLOs, no SLO group.
    assert [g["name"] for g in render_rules(_spec(tmp_path, {}))["groups"]] == [
        "servemesh-sli",
        "servemesh-cost",
        "servemesh-drift",
        "servemesh-host",
    ]


@pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package `prometheus`)"
)
def test_the_slo_rules_pass_promtool(tmp_path: Path) -> None:
    slos = {
        "fraud": SloSpec(availability=0.999, p99_ms=250, window="1h"),
        "wine": SloSpec(availability=0.99, p99_ms=120_000, window="30d"),
    }
    spec = _spec(tmp_path, slos)
    with Supervisor(tmp_path / "logs") as supervisor:
        server = PrometheusServer(supervisor, spec, tmp_path / "prometheus", "prometheus")
        server.write_config()
    assert PROMTOOL is not None
    checked = subprocess.run(
        [PROMTOOL, "check", "rules", str(server.rules_file)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    written = yaml.safe_load(server.rules_file.read_text())
    count = sum(len(g["rules"]) for g in written["groups"])
    assert f"SUCCESS: {count} rules found" in checked.stdout


GATEWAY_TEXT = """
# TYPE servemesh_gateway_predictions counter
servemesh_gateway_predictions_total{model="fraud",version="v1",degraded="false",code="OK"} 900
servemesh_gateway_predictions_total{model="fraud",version="fallback",degraded="true",code="OK"} 4
servemesh_gateway_predictions_total{model="fraud",version="v2",degraded="false",code="INTERNAL"} 6
servemesh_gateway_predictions_total{model="fraud",version="",code="INVALID_ARGUMENT"} 90
servemesh_gateway_predictions_total{model="wine",version="v1",degraded="false",code="INTERNAL"} 50
# TYPE servemesh_gateway_predict_duration_seconds histogram
servemesh_gateway_predict_duration_seconds_bucket{model="fraud",version="v1",le="0.1"} 980
servemesh_gateway_predict_duration_seconds_bucket{model="fraud",version="v1",le="0.25"} 995
servemesh_gateway_predict_duration_seconds_bucket{model="fraud",version="v1",le="+Inf"} 1000
servemesh_gateway_predict_duration_seconds_count{model="fraud",version="v1"} 1000
servemesh_gateway_predict_duration_seconds_sum{model="fraud",version="v1"} 20.0
"""


def test_counts_from_the_gateways_counters_follow_the_rules_definitions() -> None:
    slo = SloSpec(availability=0.99, p99_ms=200)
    availability, latency = count_from_samples(parse(GATEWAY_TEXT), "fraud", slo)
    # 6 failed + 4 degraded of 1,000; the caller's 90 INVALID_ARGUMENT spend nothing.
    assert (availability.total, availability.bad) == (1000, 10)
    assert availability.allowed == pytest.approx(10)
    assert availability.left == pytest.approx(0.0)
    # p99 200 ms rounds up to the 250 ms bucket: 5 of 1,000 above it, 10 allowed.
    assert (latency.total, latency.bad) == (1000, 5)
    assert latency.left == pytest.approx(0.5)


def reading(
    availability: ObjectiveBudget, latency: ObjectiveBudget, burn: dict[tuple[str, str], float]
) -> BudgetReading:
    slo = SloSpec(availability=0.999, p99_ms=250, window="1h")
    fast, slow = burn_windows(slo.window_s, 2.0)
    return BudgetReading(
        model="fraud",
        slo=slo,
        source="prometheus",
        span="over the last 1h",
        objectives=(availability, latency),
        fast=fast,
        slow=slow,
        burn=burn,
    )


def test_a_spent_budget_refuses_and_says_so_first() -> None:
    spent = reading(
        ObjectiveBudget("availability", 2000, 300, 0.001),
        ObjectiveBudget("latency", 2000, 0, 0.01),
        {("availability", "8s"): 150.0, ("availability", "30s"): 149.0},
    )
    assert spent.spent and spent.refuses
    assert spent.detail() == (
        "budget spent: budget left -14900.0% over the last 1h "
        "(availability -14900.0% left: 300 failed or degraded of 2,000 calls, 2 allowed at "
        "99.9%; latency 100.0% left: 0 slower than 250 ms (over 250 ms) of 2,000, 20 allowed); "
        "fast burn over 8s/8s (limit 9): availability 150/150, latency 0/0; "
        "slow burn over 8s/30s (limit 6): availability 150/149, latency 0/0"
    )


def test_a_fast_burn_refuses_while_budget_is_left_and_a_slow_one_does_not() -> None:
    healthy = ObjectiveBudget("availability", 100_000, 10, 0.001)
    latency = ObjectiveBudget("latency", 100_000, 0, 0.01)
    fast = reading(healthy, latency, {("availability", "8s"): 12.0})
    assert not fast.spent and fast.refuses
    assert fast.detail().startswith("fast burn over 9 (availability): budget left 90.0%")
    # Over the slow threshold (6) in both slow windows, under the fast one (9).
    slow = reading(healthy, latency, {("availability", "8s"): 7.0, ("availability", "30s"): 7.0})
    assert slow.burning(slow.slow) == ["availability"]
    assert not slow.refuses
    assert slow.detail().startswith("budget left 90.0% over the last 1h")


def test_a_model_without_calls_has_its_whole_budget() -> None:
    idle = ObjectiveBudget("availability", 0, 0, 0.001)
    assert idle.left == 1.0 and idle.burn == 0.0
