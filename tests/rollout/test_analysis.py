"""Canary analysis on numbers worked by hand: windows of cumulative snapshots, the p99 of
buckets, PSI and KS, the verdicts and their details, and the shadow ledger's counts."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from servemesh.rollout.analysis import (
    LEDGER_LATENCY_BOUNDS_S,
    SCORE_BOUNDS,
    ArmSnapshot,
    LedgerSource,
    judge,
    p99_s,
    window,
)
from servemesh.rollout.stats import (
    binomial_tail,
    bucket_quantile,
    chi2_sf,
    count_above,
    ks_distance,
    merged_bins,
    psi,
)
from servemesh.rollout.types import ArmWindow, Check
from servemesh.services.model.shadow import ShadowLedger
from servemesh.spec.rollout_plan import AnalysisSpec

LAT = LEDGER_LATENCY_BOUNDS_S
ANALYSIS = AnalysisSpec(min_samples=100)


def _bucketed(values: list[float], bounds: tuple[float, ...]) -> tuple[int, ...]:
    counts = [0] * len(bounds)
    for v in values:
        counts[next(i for i, b in enumerate(bounds) if v <= b)] += 1
    return tuple(counts)


def _arm(
    version: str,
    requests: int,
    errors: int = 0,
    *,
    latencies_s: list[float] | None = None,
    scores: list[float] | None = None,
) -> ArmWindow:
    latencies_s = latencies_s if latencies_s is not None else [0.004] * (requests - errors)
    scores = scores if scores is not None else []
    return ArmWindow(
        version=version,
        requests=requests,
        errors=errors,
        latency_bounds_s=LAT,
        latency_buckets=_bucketed(latencies_s, LAT),
        score_bounds=SCORE_BOUNDS,
        score_buckets=_bucketed(scores, SCORE_BOUNDS),
    )


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


# --- the arithmetic ------------------------------------------------------------------------


def test_bucket_quantile_interpolates_inside_the_bucket_as_histogram_quantile_does() -> None:
    bounds = (0.1, 0.2, math.inf)
    assert bucket_quantile(0.5, bounds, (50, 50, 0)) == pytest.approx(0.1)
    # rank 99 of 100 lies 49/50 of the way through the (0.1, 0.2] bucket
    assert bucket_quantile(0.99, bounds, (50, 50, 0)) == pytest.approx(0.1 + 0.1 * 49 / 50)
    # in the +Inf bucket Prometheus answers the highest finite bound
    assert bucket_quantile(0.99, bounds, (0, 10, 90)) == pytest.approx(0.2)
    assert math.isnan(bucket_quantile(0.99, bounds, (0, 0, 0)))


def test_psi_of_identical_shares_is_zero_and_of_moved_mass_is_worked_by_hand() -> None:
    assert psi([10, 20, 70], [1, 2, 7]).value == pytest.approx(0.0)
    # Two bins, 50/50 against 20/80: (0.2-0.5)ln(0.2/0.5) + (0.8-0.5)ln(0.8/0.5)
    by_hand = -0.3 * math.log(0.4) + 0.3 * math.log(1.6)
    assert psi([50, 50], [20, 80], max_bins=2).value == pytest.approx(by_hand)
    # An empty bin on one side is floored at epsilon, not infinite.
    moved = psi([100, 0], [0, 100], max_bins=2)
    assert math.isfinite(moved.value) and moved.value > 10


def test_psi_merges_the_fine_buckets_into_about_ten_bins_of_pooled_mass() -> None:
    baseline = [10] * 20  # flat over twenty buckets
    ends = merged_bins(baseline, baseline, 10)
    assert ends == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    # Empty buckets join their neighbours; a thin tail joins the last bin.
    assert merged_bins([0, 50, 0, 50, 0, 1], [0, 50, 0, 50, 0, 0], 2) == [3, 6]
    result = psi(baseline, baseline)
    assert result.bins == 10 and result.noise == pytest.approx(9 * (1 / 200 + 1 / 200))


def test_ks_is_the_largest_gap_between_cumulative_shares() -> None:
    assert ks_distance([50, 50, 0], [50, 50, 0]) == 0.0
    assert ks_distance([100, 0, 0], [0, 100, 0]) == 1.0
    assert ks_distance([50, 50], [25, 75]) == pytest.approx(0.25)
    assert math.isnan(ks_distance([0, 0], [1, 1]))


# --- windows -------------------------------------------------------------------------------


def test_a_window_is_after_minus_before_per_version_and_a_reset_counts_from_zero() -> None:
    before = ArmSnapshot(
        "fraud",
        "endpoints",
        1.0,
        {"v1": _arm("v1", 100, 1, scores=[0.5] * 99), "v2": _arm("v2", 50)},
    )
    after = ArmSnapshot(
        "fraud",
        "endpoints",
        2.0,
        {
            "v1": _arm("v1", 250, 4, scores=[0.5] * 200 + [0.9] * 46),
            "v2": _arm("v2", 20),  # went down: its gateway restarted
            "v3": _arm("v3", 7),  # new: counts whole
        },
    )
    got = window(before, after)
    assert (got["v1"].requests, got["v1"].errors) == (150, 3)
    assert sum(got["v1"].latency_buckets) == 246 - 99
    v1_scores = dict(zip(SCORE_BOUNDS, got["v1"].score_buckets, strict=True))
    assert v1_scores[0.5] == 101 and v1_scores[0.9] == 46
    assert got["v2"].requests == 20 and got["v3"].requests == 7


def test_a_window_needs_one_model_and_one_source() -> None:
    a = ArmSnapshot("fraud", "endpoints", 1.0, {})
    with pytest.raises(ValueError, match="two sources"):
        window(a, ArmSnapshot("fraud", "prometheus", 2.0, {}))
    with pytest.raises(ValueError, match="two models"):
        window(a, ArmSnapshot("other", "endpoints", 2.0, {}))


def test_a_snapshot_survives_json_whole() -> None:
    snap = ArmSnapshot("fraud", "prometheus", 3.5, {"v1": _arm("v1", 10, 2, scores=[0.1] * 8)})
    again = ArmSnapshot.from_dict(json.loads(json.dumps(snap.as_dict())))
    assert again == snap


# --- verdicts ------------------------------------------------------------------------------


def _scores(rng: random.Random, n: int, shift: float = 0.0) -> list[float]:
    return [min(max(rng.betavariate(2, 5) + shift, 0.0), 1.0) for _ in range(n)]


def test_a_good_canary_passes_every_check() -> None:
    rng = random.Random(7)
    baseline = _arm("v1", 4000, 1, scores=_scores(rng, 3999))
    canary = _arm("v2", 400, 0, scores=_scores(rng, 400))
    checks = judge(baseline, canary, ANALYSIS)
    assert [c.name for c in checks] == ["error_ratio", "p99", "psi"]
    assert {c.verdict for c in checks} == {"pass"}, checks


def test_a_canary_failing_30_percent_fails_error_ratio_naming_the_numbers() -> None:
    checks = _by_name(judge(_arm("v1", 1000), _arm("v2", 1000, 301), ANALYSIS))
    assert checks["error_ratio"].verdict == "fail"
    assert checks["error_ratio"].detail.startswith(
        "error ratio 30.10% vs baseline 0.00% (+30.10 points > +0.1"
    )


def test_error_ratio_is_relative_to_the_baseline() -> None:
    # Both arms fail 2%: the canary is no worse.
    checks = _by_name(judge(_arm("v1", 1000, 20), _arm("v2", 1000, 20), ANALYSIS))
    assert checks["error_ratio"].verdict == "pass"


def test_a_canary_100_ms_slower_fails_p99() -> None:
    baseline = _arm("v1", 500, latencies_s=[0.004] * 495 + [0.02] * 5)
    canary = _arm("v2", 500, latencies_s=[0.104] * 495 + [0.12] * 5)
    check = _by_name(judge(baseline, canary, ANALYSIS))["p99"]
    assert check.verdict == "fail", check
    assert "vs baseline" in check.detail and "> 1.2x" in check.detail
    assert p99_s(canary) > 0.1


def test_p99_within_the_slack_passes_though_the_ratio_is_over() -> None:
    # 2 ms against 4 ms is twice as slow but 2 ms of it: below what buckets resolve.
    baseline = _arm("v1", 500, latencies_s=[0.002] * 500)
    canary = _arm("v2", 500, latencies_s=[0.004] * 500)
    assert _by_name(judge(baseline, canary, ANALYSIS))["p99"].verdict == "pass"
    strict = AnalysisSpec(min_samples=100, p99_slack_ms=0)
    assert _by_name(judge(baseline, canary, strict))["p99"].verdict == "fail"


def test_count_above_takes_whole_buckets_and_the_straddled_one_by_its_share() -> None:
    bounds, counts = (0.01, 0.02, 0.04, math.inf), (10, 10, 20, 4)
    assert count_above(0.04, bounds, counts) == 4  # only the +inf bucket
    assert count_above(0.03, bounds, counts) == pytest.approx(4 + 20 * 0.5)
    assert count_above(0.0, bounds, counts) == 44


def test_binomial_tail_by_hand() -> None:
    # P(X >= 2) for n=3, p=0.5: 3/8 + 1/8.
    assert binomial_tail(2, 3, 0.5) == pytest.approx(0.5)
    # Every one of 20 calls in a 1% tail: 1e-40.
    assert binomial_tail(20, 20, 0.01) == pytest.approx(1e-40)
    assert binomial_tail(0, 20, 0.01) == 1.0


def test_one_slow_call_among_a_few_dozen_does_not_fail_p99() -> None:
    # 25 canary calls: their p99 is their maximum, and one met a pause.
    baseline = _arm("v1", 500, latencies_s=[0.004] * 500)
    canary = _arm("v2", 25, latencies_s=[0.004] * 24 + [0.09])
    check = _by_name(judge(baseline, canary, AnalysisSpec(min_samples=20)))["p99"]
    assert check.verdict == "pass", check
    assert "1 of 25 canary calls above" in check.detail and "within a 1% tail" in check.detail
    # Every one of them slow is another matter, few as they are.
    slow = _arm("v2", 25, latencies_s=[0.09] * 25)
    check = _by_name(judge(baseline, slow, AnalysisSpec(min_samples=20)))["p99"]
    assert check.verdict == "fail", check
    assert "25 of 25 canary calls above" in check.detail


def test_shifted_scores_fail_psi_and_the_detail_names_it() -> None:
    rng = random.Random(11)
    baseline = _arm("v1", 3000, scores=_scores(rng, 3000))
    canary = _arm("v2", 600, scores=_scores(rng, 600, shift=0.25))
    check = _by_name(judge(baseline, canary, ANALYSIS))["psi"]
    assert check.verdict == "fail", check
    assert check.detail.startswith("PSI ") and "> 0.2" in check.detail and "KS" in check.detail


def test_psi_waits_while_chance_alone_could_reach_the_limit() -> None:
    rng = random.Random(3)
    baseline = _arm("v1", 3000, scores=_scores(rng, 3000))
    canary = _arm("v2", 120, scores=_scores(rng, 120))
    check = _by_name(judge(baseline, canary, ANALYSIS))["psi"]
    assert check.verdict == "wait" and "too few scores" in check.detail


def test_psi_over_the_limit_waits_when_chance_could_give_it() -> None:
    # A good canary's handful of scores against the baseline's (seen in a real rollout: 26
    # against 31 over two bins, PSI 0.55 > 0.5): a shift that large happens by chance at
    # these sizes about once in two hundred windows. Wait for more.
    baseline = _arm("v1", 31, scores=[0.2] * 15 + [0.8] * 16)
    canary = _arm("v2", 26, scores=[0.2] * 22 + [0.8] * 4)
    loose = AnalysisSpec(min_samples=20, max_psi=0.5)
    check = _by_name(judge(baseline, canary, loose))["psi"]
    assert check.verdict == "wait", check
    assert "which chance alone could give" in check.detail and "> 0.5" in check.detail
    # The same shares over ten times the scores are no chance.
    many = _arm("v1", 310, scores=[0.2] * 150 + [0.8] * 160)
    moved = _arm("v2", 260, scores=[0.2] * 220 + [0.8] * 40)
    check = _by_name(judge(many, moved, loose))["psi"]
    assert check.verdict == "fail", check


def test_chi2_survival_matches_the_tables() -> None:
    # The 5% and 0.1% critical values of chi-square at 1, 2, 5 and 9 degrees of freedom.
    for x, df, p in ((3.841, 1, 0.05), (5.991, 2, 0.05), (11.070, 5, 0.05), (16.919, 9, 0.05),
                     (10.828, 1, 0.001), (27.877, 9, 0.001)):  # fmt: skip
        assert chi2_sf(x, df) == pytest.approx(p, rel=2e-3), (x, df)
    assert chi2_sf(0.0, 3) == 1.0


def test_a_model_without_scores_passes_psi() -> None:
    check = _by_name(judge(_arm("v1", 500), _arm("v2", 500), ANALYSIS))["psi"]
    assert check.verdict == "pass" and "no scores" in check.detail


def test_too_few_calls_in_either_arm_waits_on_every_check() -> None:
    checks = judge(_arm("v1", 5000), _arm("v2", 40, 40), ANALYSIS)
    assert checks[0] == Check("samples", "wait", "canary 40, baseline 5000 calls; 100 each needed")
    assert {c.verdict for c in checks} == {"wait"}
    # The numbers are already there for whoever watches.
    assert "100.00%" in _by_name(checks)["error_ratio"].detail


# --- the shadow step: what the replicas recorded -------------------------------------------


def _record(ledger: ShadowLedger, role: str, version: str, i: int, **extra: object) -> None:
    entry = {
        "role": role,
        "request_id": f"r{i}",
        "replica": "model-fraud-zone-a-0",
        "model": "fraud",
    }
    ledger.append(entry | {"version": version} | extra)


def test_the_ledger_source_counts_both_sides_by_version_and_reads_only_whole_new_lines(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "shadow"
    ledger = ShadowLedger(folder / "model-fraud-zone-a-0.jsonl", max_bytes=4000)
    source = LedgerSource(folder)
    for i in range(30):
        _record(ledger, "primary", "v1", i, scores=[0.2], ms=3.0)
        if i % 3 == 0:
            _record(ledger, "shadow", "v2", i, error="RuntimeError", ms=1.0)
        else:
            _record(ledger, "shadow", "v2", i, scores=[0.8], ms=110.0)
    ledger.close()
    first = source.snapshot("fraud")
    assert (first.arms["v1"].requests, first.arms["v1"].errors) == (30, 0)
    assert (first.arms["v2"].requests, first.arms["v2"].errors) == (30, 10)
    assert p99_s(first.arms["v2"]) > 0.1 > p99_s(first.arms["v1"])
    # The ledger rolled over to .1 on the way (4 kB): nothing was counted twice or lost.
    assert (folder / "model-fraud-zone-a-0.jsonl.1").exists()
    # A line still being written is left for the next read.
    with (folder / "model-fraud-zone-a-0.jsonl").open("a") as handle:
        handle.write('{"role": "primary", "model": "fraud", "vers')
    assert source.snapshot("fraud").arms["v1"].requests == 30
    with (folder / "model-fraud-zone-a-0.jsonl").open("a") as handle:
        handle.write('ion": "v1", "scores": [0.2], "ms": 2.0}\n')
    later = source.snapshot("fraud")
    assert window(first, later)["v1"].requests == 1
    # A second reader starts from what is on disk: the same totals.
    assert LedgerSource(folder).snapshot("fraud").arms["v2"] == later.arms["v2"]


@pytest.mark.parametrize(
    ("bad", "check"),
    [
        ("errors", "error_ratio"),
        ("slow", "p99"),
        ("shifted", "psi"),
    ],
)
def test_the_shadow_step_catches_each_bad_version(tmp_path: Path, bad: str, check: str) -> None:
    rng = random.Random(5)
    folder = tmp_path / "shadow"
    ledger = ShadowLedger(folder / "model-fraud-zone-b-0.jsonl")
    source = LedgerSource(folder)
    before = source.snapshot("fraud")
    for i in range(600):
        base_ms = 3.0 + rng.random()
        _record(ledger, "primary", "v1", i, scores=[rng.betavariate(2, 5)], ms=base_ms)
        if bad == "errors" and i % 10 < 3:  # 30% of entities
            _record(ledger, "shadow", "v2", i, error="RuntimeError", ms=1.0)
            continue
        score = rng.betavariate(2, 5) + (0.3 if bad == "shifted" else 0.0)
        ms = base_ms + (100.0 if bad == "slow" else 0.0)
        _record(ledger, "shadow", "v2", i, scores=[min(score, 1.0)], ms=ms)
    ledger.close()
    windows = window(before, source.snapshot("fraud"))
    verdicts = {c.name: c.verdict for c in judge(windows["v1"], windows["v2"], ANALYSIS)}
    assert verdicts[check] == "fail", verdicts
    assert [name for name, v in verdicts.items() if v == "fail"] == [check]
