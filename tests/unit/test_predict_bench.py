"""`servemesh bench predict`'s arithmetic without a mesh: rows from rounds, paired ratios, the
spread that flags a row, and the verdicts on the issue's targets."""

from __future__ import annotations

import math

from servemesh.bench.predict import (
    ECHO,
    ECHO_TLS,
    EDGE,
    MODEL_ALONE,
    PYTHON_TLS_SIDES_PER_PREDICT,
    Round,
    bench_spec,
    heavy_spec,
    heavy_target_checks,
    mesh_cpu,
    paired_ratios,
    per_repeat_ratios,
    summarize_rows,
    target_checks,
    tls_cost_report,
)
from servemesh.load.stats import spread
from servemesh.spec import MeshSpec


def _round(target: str, c: int, repeat: int, rps: float, cpu: dict[str, float]) -> Round:
    return Round(target, c, repeat, rps, p50_ms=2.0, p99_ms=50.0 + repeat, errors=0, cpu_us=cpu)


ROUNDS = [
    _round(EDGE, 64, 0, 900.0, {"envoy": 300.0, "gateway": 500.0, "client": 200.0}),
    _round(MODEL_ALONE, 64, 0, 1800.0, {"model": 400.0, "client": 150.0}),
    _round(EDGE, 64, 1, 1000.0, {"envoy": 320.0, "gateway": 480.0, "client": 210.0}),
    _round(MODEL_ALONE, 64, 1, 1600.0, {"model": 420.0, "client": 160.0}),
    _round(EDGE, 64, 2, 1100.0, {"envoy": 310.0, "gateway": 700.0, "client": 190.0}),
    _round(MODEL_ALONE, 64, 2, 2000.0, {"model": 380.0, "client": 140.0}),
]


def test_spread_is_the_range_over_the_median() -> None:
    assert spread([90.0, 100.0, 110.0]) == 0.2
    assert spread([5.0]) == 0.0
    assert math.isinf(spread([0.0, 0.0, 1.0]))


def test_rows_take_medians_and_leave_the_client_out_of_the_mesh_sum() -> None:
    rows = {r.target: r for r in summarize_rows(ROUNDS, wide={(MODEL_ALONE, 64)})}
    edge = rows[EDGE]
    assert edge.rps_median == 1000.0 and (edge.rps_min, edge.rps_max) == (900.0, 1100.0)
    assert edge.cpu_us_per_answer == {"client": 200.0, "envoy": 310.0, "gateway": 500.0}
    # Per round: 800, 800, 1010 µs for the mesh; the client's own CPU is not the mesh's.
    assert (edge.cpu_us_mesh_median, edge.cpu_us_mesh_max) == (800.0, 1010.0)
    assert edge.p99_ms_max == 52.0 and not edge.flagged_wide
    assert rows[MODEL_ALONE].flagged_wide


def test_ratios_pair_rounds_of_the_same_repeat() -> None:
    assert paired_ratios(ROUNDS, 64) == [0.5, 1000.0 / 1600.0, 0.55]
    assert paired_ratios(ROUNDS, 1) == []


def test_targets_are_ratios_of_the_same_repeat_and_bounds() -> None:
    echo = [_round(ECHO, 64, i, 3000.0, {"echo": 400.0, "client": 100.0}) for i in range(3)]
    rounds = [*ROUNDS, *echo]
    # Per repeat: 800, 800, 1010 µs of mesh CPU against 400 for the echo.
    cpu = per_repeat_ratios(rounds, 64, mesh_cpu, EDGE, ECHO)
    assert cpu == [2.0, 2.0, 2.525]
    rps = per_repeat_ratios(rounds, 64, lambda r: r.rps, EDGE, MODEL_ALONE)
    assert rps == paired_ratios(ROUNDS, 64)
    rows = summarize_rows(rounds, wide=set())
    assert {r.target: r.cpu_us_mesh_median for r in rows}[ECHO] == 400.0
    idle = {"cpu_ms_per_s_total": 75.5, "rss_mib_total": 1000.0}
    verdicts = {
        c["target"]: (c["measured"], c["met"])
        for c in target_checks(rows, {"cpu_over_echo_c64": cpu, "rps_over_alone_c64": rps}, idle)
    }
    assert verdicts == {
        "mesh CPU per Predict / echo CPU per call, c=64 <=": (2.0, True),
        "edge req/s / model alone req/s, c=64 >=": (0.55, False),
        "idle mesh CPU ms/s <=": (75.5, False),
        "edge p99 ms, c=64 <=": (51.0, True),
        "mesh memory (RSS) MiB <=": (1000.0, True),
    }


def test_the_heavy_spec_serves_the_heavy_model_alone_on_the_first_models_view() -> None:
    spec = heavy_spec(MeshSpec())
    assert list(spec.models) == ["heavy"]
    heavy = spec.models["heavy"]
    assert {v: s.source for v, s in heavy.versions.items()} == {
        "v1": "demo-heavy:1",
        "v2": "demo-heavy:2",
    }
    assert heavy.traffic == {"v1": 100, "v2": 0}
    assert heavy.feature_view == MeshSpec().models["fraud"].feature_view
    assert heavy.tiers is None and heavy.shadow is None


def test_the_heavy_target_is_the_mesh_over_its_model_server_alone() -> None:
    [check] = heavy_target_checks({"rps_over_alone_c64": [0.8, 0.9, 0.86]})
    assert check["measured"] == 0.86 and check["goal"] == 0.85 and check["met"] is True
    [check] = heavy_target_checks({"rps_over_alone_c64": [0.8, 0.84, 0.9]})
    assert check["met"] is False
    assert heavy_target_checks({}) == []


def test_the_bench_mesh_lets_its_one_caller_use_the_edge_s_whole_rate() -> None:
    spec = MeshSpec()
    limit = bench_spec(spec).traffic.rate_limit
    # The buckets stay (their cost is measured); the one load generator is not shed by its
    # own bucket before the mesh is full.
    assert limit.enabled
    assert limit.per_caller_requests_per_second == limit.requests_per_second
    assert limit.per_caller_burst == limit.burst
    assert spec.traffic.rate_limit.per_caller_requests_per_second < limit.requests_per_second
    assert bench_spec(spec).metrics.prometheus == "off"


def test_tls_cost_pairs_each_tls_echo_round_with_the_plain_echo_round_of_its_repeat() -> None:
    rounds = [
        _round(ECHO, 64, 0, 4000.0, {"echo": 200.0, "client": 150.0}),
        _round(ECHO_TLS, 64, 0, 3500.0, {"echo": 230.0, "client": 170.0}),  # +50 µs
        _round(ECHO, 64, 1, 3000.0, {"echo": 260.0, "client": 190.0}),  # a slower repeat
        _round(ECHO_TLS, 64, 1, 2700.0, {"echo": 300.0, "client": 210.0}),  # +60 µs
        _round(ECHO_TLS, 64, 2, 2600.0, {"echo": 900.0, "client": 900.0}),  # no pair: left out
        _round(ECHO, 1, 0, 1000.0, {"echo": 300.0, "client": 200.0}),  # no TLS round at c=1
    ]
    found = tls_cost_report(rounds, [1, 64])
    assert list(found) == ["64"]
    c64 = found["64"]
    assert isinstance(c64, dict)
    assert c64["us_per_call_added"]["per_repeat"] == [50.0, 60.0]
    assert c64["cpu_ratio"]["per_repeat"] == [round(400 / 350, 3), round(510 / 450, 3)]
    assert c64["rps_ratio"]["per_repeat"] == [0.875, 0.9]
    # Half the pair's cost for each of a Predict's Python TLS sides.
    assert c64["us_per_predict_python_sides"] == 55.0 / 2 * PYTHON_TLS_SIDES_PER_PREDICT
