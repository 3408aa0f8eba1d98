"""Canary analysis: what each version of a model did between two moments, and whether the
canary did worse than its baseline over the same window.

A snapshot holds cumulative counters per version (calls, failed calls, latency and score
buckets); a window is the difference of two; a judgement compares the canary's window with
the baseline's (docs/rollouts-analysis.md has the method).

Where the counters come from:

- After the shadow step, the gateways' per-version metrics (services/gateway/metrics.py):
  `servemesh_gateway_model_calls_total` (every ModelInfer, by the version Envoy routed it
  to and its status, also those a fallback then answered), `..._predict_duration_seconds`
  (what callers waited, by version) and `..._prediction_score` (the scores answered, by
  version). From the mesh's Prometheus when it runs one (instant queries of the cumulative
  series, summed over gateways), else from every gateway's own /metrics endpoint. Only
  routed calls count (`route="routed"`: the traffic split chose the version): a caller who
  pins a version chooses its rows and deadlines, and could steer the verdict either way.
  Pinned calls are counted apart (`ArmSnapshot.pinned`, `pinned_between`) and reported,
  never judged.
- At the shadow step the canary answers nobody, so the gateways never see it: both sides'
  replicas record each shadowed call (services/model/shadow.py, `<state_dir>/shadow/`):
  the primary's answer and the canary's copy, with its status, time and scores.

A version's errors are calls that ended in one of wire.SLI_FAILURE_CODES (UNAVAILABLE,
INTERNAL, UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, DATA_LOSS, UNIMPLEMENTED): the
service failed, the same codes the SLO recording rules count. A caller's own mistakes
(INVALID_ARGUMENT, NOT_FOUND, ...) and a caller giving up (CANCELLED) are not: they say
nothing about the version and fall on both arms alike.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from servemesh.contract.errors import ServemeshError
from servemesh.contract.wire import (
    LATENCY_BUCKETS_S,
    ROUTE_PINNED,
    SCORE_BUCKETS,
    SLI_FAILURE_CODES,
)
from servemesh.observe.prom_query import PromClient, PrometheusError
from servemesh.observe.scrape import Sample, scrape
from servemesh.rollout.stats import (
    binomial_tail,
    bucket_quantile,
    count_above,
    ks_distance,
    psi,
    psi_chance,
)
from servemesh.rollout.types import ArmWindow, Check
from servemesh.spec import ResolvedSpec
from servemesh.spec.rollout_plan import AnalysisSpec

MODEL_CALLS = "servemesh_gateway_model_calls_total"
# Series of a gateway from before the route label count as routed (`!=`, not `=`).
NOT_PINNED = f'route!="{ROUTE_PINNED}"'
PREDICT_SECONDS = "servemesh_gateway_predict_duration_seconds"
SCORES = "servemesh_gateway_prediction_score"
# Versions that are no arm: a call that failed before any version was picked, and the
# gateway's degraded fallback answer.
NOT_ARMS = frozenset({"", "fallback"})
FAILED_CODES = frozenset(SLI_FAILURE_CODES)
# Replica-side latency of shadowed calls is bucketed like every service's RPC histogram,
# so both steps' p99s read alike.
LEDGER_LATENCY_BOUNDS_S = (*LATENCY_BUCKETS_S, math.inf)
SCORE_BOUNDS = (*SCORE_BUCKETS, math.inf)

Source = Literal["auto", "prometheus", "endpoints"]


class ArmSourceError(ServemeshError, RuntimeError):
    """The counters could not be read (Prometheus or a gateway did not answer)."""


@dataclass(frozen=True)
class ArmSnapshot:
    """Cumulative per-version counters of one model at one moment.

    `arms` holds, per version, its totals so far as an ArmWindow (requests, errors and
    per-bucket counts since its counters started). `source` names where they were read
    ("prometheus", "endpoints", "shadow ledger"): two snapshots make a window only when
    they come from the same source. Plain data: `as_dict`/`from_dict` round-trip through
    JSON, so a controller can keep the start of a window across its own restart."""

    model: str
    source: str
    taken_at: float  # time.time() of the reading
    arms: Mapping[str, ArmWindow] = field(default_factory=dict)
    # ModelInfer calls by version that callers pinned: never in `arms`, reported apart.
    pinned: Mapping[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "source": self.source,
            "taken_at": self.taken_at,
            "arms": {v: asdict(a) for v, a in self.arms.items()},
            "pinned": dict(self.pinned),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ArmSnapshot:
        def arm(raw: Mapping[str, Any]) -> ArmWindow:
            return ArmWindow(
                version=str(raw["version"]),
                requests=int(raw["requests"]),
                errors=int(raw["errors"]),
                latency_bounds_s=tuple(float(b) for b in raw.get("latency_bounds_s", ())),
                latency_buckets=tuple(int(c) for c in raw.get("latency_buckets", ())),
                score_bounds=tuple(float(b) for b in raw.get("score_bounds", ())),
                score_buckets=tuple(int(c) for c in raw.get("score_buckets", ())),
            )

        return cls(
            model=str(data["model"]),
            source=str(data["source"]),
            taken_at=float(data["taken_at"]),
            arms={str(v): arm(a) for v, a in dict(data.get("arms") or {}).items()},
            pinned={str(v): int(n) for v, n in dict(data.get("pinned") or {}).items()},
        )


class ArmSource(Protocol):
    def snapshot(self, model: str, *, shadow: bool) -> ArmSnapshot:
        """The model's per-version counters now: from what the replicas recorded of
        shadowed calls when `shadow`, else from the gateways' per-version metrics."""
        ...


# --- windows -----------------------------------------------------------------------------


def _minus(after: tuple[int, ...], before: tuple[int, ...]) -> tuple[int, ...]:
    if len(before) != len(after):
        return after  # the buckets changed (a restart with other bounds): count afresh
    return tuple(max(a - b, 0) for a, b in zip(after, before, strict=True))


def window(before: ArmSnapshot, after: ArmSnapshot) -> dict[str, ArmWindow]:
    """What each version did between two snapshots of the same model and source. A
    version missing from `before` counts whole; a counter that went down (a gateway
    restarted) counts from zero, as Prometheus' increase() does."""
    if before.model != after.model:
        raise ValueError(f"snapshots of two models: {before.model!r} and {after.model!r}")
    if before.source != after.source:
        raise ValueError(
            f"snapshots from two sources ({before.source}, {after.source}) make no window"
        )
    found: dict[str, ArmWindow] = {}
    for version, now in after.arms.items():
        then = before.arms.get(version)
        if then is None or now.requests < then.requests:
            found[version] = now
            continue
        found[version] = replace(
            now,
            requests=now.requests - then.requests,
            errors=max(now.errors - then.errors, 0),
            latency_buckets=_minus(now.latency_buckets, then.latency_buckets)
            if now.latency_bounds_s == then.latency_bounds_s
            else now.latency_buckets,
            score_buckets=_minus(now.score_buckets, then.score_buckets)
            if now.score_bounds == then.score_bounds
            else now.score_buckets,
        )
    return found


def pinned_between(before: object, after: object) -> dict[str, int]:
    """The calls callers pinned to each version between two snapshots (not judged; shown
    beside the verdict). A counter that went down counts from zero."""
    then: Mapping[str, int] = getattr(before, "pinned", None) or {}
    now: Mapping[str, int] = getattr(after, "pinned", None) or {}
    found = {}
    for version, count in now.items():
        earlier = then.get(version, 0)
        found[version] = count - earlier if count >= earlier else count
    return {v: n for v, n in sorted(found.items()) if n > 0}


# --- judgement ---------------------------------------------------------------------------


def _pct(ratio: float) -> str:
    return f"{ratio * 100:.2f}%"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def p99_s(arm: ArmWindow) -> float:
    """The arm's p99 latency in seconds from its buckets (NaN without observations)."""
    if not arm.latency_buckets:
        return math.nan
    return bucket_quantile(0.99, arm.latency_bounds_s, arm.latency_buckets)


def _error_ratio(baseline: ArmWindow, canary: ArmWindow, limit: float) -> Check:
    increase = (canary.error_ratio - baseline.error_ratio) * 100
    failed = increase > limit
    detail = (
        f"error ratio {_pct(canary.error_ratio)} vs baseline {_pct(baseline.error_ratio)} "
        f"({increase:+.2f} points {'>' if failed else '<='} +{limit:g}; "
        f"{canary.errors} of {canary.requests} calls failed)"
    )
    return Check("error_ratio", "fail" if failed else "pass", detail)


# The p99 check fails only when the canary's calls over the limit are more than a 1% tail
# could hold by chance, at this significance: with a few dozen calls a p99 is their maximum,
# and one call that met a GC pause or a route change would fail a good version.
P99_TAIL_ALPHA = 0.001
# Likewise the PSI check fails only when a PSI over the limit is this unlikely between two
# samples of one distribution of the arms' sizes.
PSI_ALPHA = 0.001


def _p99(baseline: ArmWindow, canary: ArmWindow, analysis: AnalysisSpec) -> Check:
    base, mine = p99_s(baseline), p99_s(canary)
    if math.isnan(base) or math.isnan(mine):
        return Check("p99", "wait", "p99: no latency recorded yet in one arm")
    ratio = mine / base if base > 0 else math.inf
    slack_s = analysis.p99_slack_ms / 1000
    # Both the ratio and an absolute margin must be exceeded: at a few milliseconds a 1.2x
    # limit is a fraction of one bucket, which no sample can resolve.
    limit = max(base * analysis.max_p99_ratio, base + slack_s)
    calls = round(sum(canary.latency_buckets))
    over = round(count_above(limit, canary.latency_bounds_s, canary.latency_buckets))
    chance = binomial_tail(over, calls, 0.01)
    failed = mine > limit and chance < P99_TAIL_ALPHA
    tail = f"{over} of {calls} canary calls above {_ms(limit)}"
    if failed:
        detail = (
            f"p99 {_ms(mine)} vs baseline {_ms(base)} ({ratio:.2f}x > "
            f"{analysis.max_p99_ratio:g}x and +{_ms(mine - base)} > "
            f"+{analysis.p99_slack_ms:g} ms): {tail}, more than a 1% tail holds "
            f"(p={chance:.1g})"
        )
    else:
        detail = f"p99 {_ms(mine)} vs baseline {_ms(base)} ({ratio:.2f}x): {tail}, within a 1% tail"
    return Check("p99", "fail" if failed else "pass", detail)


def _psi(baseline: ArmWindow, canary: ArmWindow, analysis: AnalysisSpec) -> Check:
    base_n, mine_n = sum(baseline.score_buckets), sum(canary.score_buckets)
    if base_n == 0 and mine_n == 0:
        return Check("psi", "pass", "no scores in either arm (the model answers named outputs)")
    if baseline.score_bounds != canary.score_bounds or base_n == 0 or mine_n == 0:
        return Check("psi", "wait", f"scores: baseline {base_n}, canary {mine_n}")
    result = psi(baseline.score_buckets, canary.score_buckets)
    ks = ks_distance(baseline.score_buckets, canary.score_buckets)
    # Two samples of one distribution show a PSI of about `noise`: judge only once that is
    # well below the limit, or a good canary with few calls would fail by chance.
    if result.noise > analysis.max_psi / 4:
        return Check(
            "psi",
            "wait",
            f"PSI {result.value:.3f} over {result.bins} bins, too few scores to judge "
            f"(noise {result.noise:.3f} > {analysis.max_psi / 4:.3f}; baseline {base_n}, "
            f"canary {mine_n})",
        )
    over = result.value > analysis.max_psi
    chance = psi_chance(result, base_n, mine_n)
    detail = (
        f"PSI {result.value:.3f} {'>' if over else '<='} {analysis.max_psi:g} over "
        f"{result.bins} bins (KS {ks:.3f}; baseline {base_n}, canary {mine_n} scores"
        + (f", p={chance:.1g})" if over else ")")
    )
    if over and chance >= PSI_ALPHA:
        # Over the limit, but two samples of one distribution this small reach it often
        # enough (seen: a good canary's 26 scores against 31 at PSI 0.55): wait for more.
        return Check("psi", "wait", f"{detail}, which chance alone could give")
    return Check("psi", "fail" if over else "pass", detail)


def judge(baseline: ArmWindow, canary: ArmWindow, analysis: AnalysisSpec) -> list[Check]:
    """The canary against the baseline over one window: `error_ratio`, `p99` and `psi`,
    each "pass" or "fail" with the numbers and the limit, or "wait" while it cannot tell;
    and while either arm has fewer than `analysis.min_samples` calls, a `samples` check
    that waits, and every other check waits with it."""
    checks = [
        _error_ratio(baseline, canary, analysis.max_error_ratio_increase_points),
        _p99(baseline, canary, analysis),
        _psi(baseline, canary, analysis),
    ]
    short = min(baseline.requests, canary.requests)
    if short >= analysis.min_samples:
        return checks
    samples = Check(
        "samples",
        "wait",
        f"canary {canary.requests}, baseline {baseline.requests} calls; "
        f"{analysis.min_samples} each needed",
    )
    return [samples] + [Check(c.name, "wait", f"(too few calls) {c.detail}") for c in checks]


# --- reading the counters ----------------------------------------------------------------


def _arms_from(
    calls: Mapping[tuple[str, str], float],
    latency: Mapping[tuple[str, float], float],
    scores: Mapping[tuple[str, float], float],
) -> dict[str, ArmWindow]:
    """ArmWindows from sums: calls by (version, code); cumulative bucket counts by
    (version, le) for latency and scores."""
    versions = {v for v, _ in calls} | {v for v, _ in latency} | {v for v, _ in scores}
    arms: dict[str, ArmWindow] = {}
    for version in sorted(versions - NOT_ARMS):
        requests = sum(n for (v, _), n in calls.items() if v == version)
        errors = sum(n for (v, code), n in calls.items() if v == version and code in FAILED_CODES)
        lat_bounds, lat_counts = _per_bucket(latency, version)
        score_bounds, score_counts = _per_bucket(scores, version)
        arms[version] = ArmWindow(
            version=version,
            requests=round(requests),
            errors=round(errors),
            latency_bounds_s=lat_bounds,
            latency_buckets=lat_counts,
            score_bounds=score_bounds,
            score_buckets=score_counts,
        )
    return arms


def _per_bucket(
    cumulative: Mapping[tuple[str, float], float], version: str
) -> tuple[tuple[float, ...], tuple[int, ...]]:
    bounds = sorted(le for v, le in cumulative if v == version)
    counts, below = [], 0
    for le in bounds:
        running = round(cumulative[(version, le)])
        counts.append(max(running - below, 0))
        below = max(running, below)
    return tuple(bounds), tuple(counts)


def _le(text: str) -> float:
    return math.inf if text in ("+Inf", "Inf", "inf") else float(text)


class EndpointsSource:
    """The gateways' own /metrics endpoints, summed; replicas' shadow records at the
    shadow step."""

    name = "endpoints"

    def __init__(self, spec: ResolvedSpec, timeout_s: float = 2.0) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self.ledger = LedgerSource(Path(spec.state_dir) / "shadow")

    def _samples(self) -> list[Sample]:
        found: list[Sample] = []
        for inst in self.spec.instances():
            if inst.service != "gateway":
                continue
            address = self.spec.metrics_address_of(inst.name)
            try:
                found += scrape(address, timeout_s=self.timeout_s)
            except OSError as exc:
                # A window without one gateway's calls would be a wrong window, not a smaller one.
                raise ArmSourceError(f"{inst.name}: /metrics at {address}: {exc}") from None
        return found

    def snapshot(self, model: str, *, shadow: bool) -> ArmSnapshot:
        if shadow:
            return self.ledger.snapshot(model, shadow=True)
        calls: dict[tuple[str, str], float] = {}
        latency: dict[tuple[str, float], float] = {}
        scores: dict[tuple[str, float], float] = {}
        pinned: dict[str, float] = {}
        for s in self._samples():
            if s.labels.get("model") != model:
                continue
            version = s.labels.get("version", "")
            if s.labels.get("route") == ROUTE_PINNED:
                if s.name == MODEL_CALLS and version not in NOT_ARMS:
                    pinned[version] = pinned.get(version, 0.0) + s.value
                continue
            if s.name == MODEL_CALLS:
                key = (version, s.labels.get("code", ""))
                calls[key] = calls.get(key, 0.0) + s.value
            elif s.name in (f"{PREDICT_SECONDS}_bucket", f"{SCORES}_bucket"):
                into = latency if s.name.startswith(PREDICT_SECONDS) else scores
                bucket = (version, _le(s.labels["le"]))
                into[bucket] = into.get(bucket, 0.0) + s.value
        arms = _arms_from(calls, latency, scores)
        return ArmSnapshot(model, self.name, time.time(), arms, _whole(pinned))


def _whole(counts: Mapping[str, float]) -> dict[str, int]:
    return {version: round(n) for version, n in sorted(counts.items())}


def _quoted(value: str) -> str:
    return json.dumps(value)  # a PromQL string literal: double quotes, backslash escapes


class PrometheusSource:
    """The mesh's Prometheus: instant queries of the gateways' cumulative series, summed
    over gateways; replicas' shadow records at the shadow step. Prometheus lags the
    services by up to a scrape interval, alike for both ends of a window."""

    name = "prometheus"

    def __init__(self, client: PromClient, spec: ResolvedSpec) -> None:
        self.client = client
        self.ledger = LedgerSource(Path(spec.state_dir) / "shadow")

    def _query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        try:
            return self.client.query(expr)
        except PrometheusError as exc:
            raise ArmSourceError(str(exc)) from None

    def snapshot(self, model: str, *, shadow: bool) -> ArmSnapshot:
        if shadow:
            return self.ledger.snapshot(model, shadow=True)
        where = f"{{model={_quoted(model)},{NOT_PINNED}}}"
        calls = {
            (labels.get("version", ""), labels.get("code", "")): value
            for labels, value in self._query(f"sum by (version, code) ({MODEL_CALLS}{where})")
        }
        pinned_where = f'{{model={_quoted(model)},route="{ROUTE_PINNED}"}}'
        pinned = {
            labels.get("version", ""): value
            for labels, value in self._query(f"sum by (version) ({MODEL_CALLS}{pinned_where})")
            if labels.get("version", "") not in NOT_ARMS
        }

        def buckets(histogram: str) -> dict[tuple[str, float], float]:
            expr = f"sum by (version, le) ({histogram}_bucket{where})"
            return {
                (labels.get("version", ""), _le(labels["le"])): value
                for labels, value in self._query(expr)
            }

        arms = _arms_from(calls, buckets(PREDICT_SECONDS), buckets(SCORES))
        return ArmSnapshot(model, self.name, time.time(), arms, _whole(pinned))


@dataclass
class _LedgerTotals:
    requests: int = 0
    errors: int = 0
    latency: list[int] = field(default_factory=lambda: [0] * len(LEDGER_LATENCY_BOUNDS_S))
    scores: list[int] = field(default_factory=lambda: [0] * len(SCORE_BOUNDS))


def _bucket_of(value: float, bounds: tuple[float, ...]) -> int:
    for i, bound in enumerate(bounds):
        if value <= bound:
            return i
    return len(bounds) - 1  # NaN: the +Inf bucket, as the gateway counts it


class LedgerSource:
    """What the replicas recorded of shadowed calls (`<state_dir>/shadow/*.jsonl*`): the
    primary's answers under the version that answered them, the shadow copies under the
    shadow version, each with its status, its time at the replica and its scores.

    Reads each ledger file once, from where it left off (files are append-only; one
    rolled over to `.1` is the same file under a new name, so files are known by inode),
    and keeps the totals: a snapshot is cumulative over everything read since this
    source was made, which starts with every line already on disk."""

    name = "shadow ledger"

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._offsets: dict[tuple[int, int], int] = {}
        self._totals: dict[tuple[str, str], _LedgerTotals] = {}

    def _read(self) -> None:
        if not self.folder.is_dir():
            return
        for path in sorted(self.folder.glob("*.jsonl*")):
            try:
                with path.open("rb") as handle:
                    stat = os.fstat(handle.fileno())
                    key = (stat.st_dev, stat.st_ino)
                    offset = self._offsets.get(key, 0)
                    if stat.st_size < offset:
                        offset = 0  # truncated: a new file under an old inode
                    handle.seek(offset)
                    data = handle.read()
            except OSError:
                continue  # rolled over between the listing and the open: next time
            whole = data.rfind(b"\n") + 1  # a line still being written waits
            self._offsets[key] = offset + whole
            for line in data[:whole].splitlines():
                self._count(line)

    def _count(self, line: bytes) -> None:
        try:
            entry = json.loads(line)
        except ValueError:
            return  # a line cut short by a crash
        if not isinstance(entry, dict) or entry.get("role") not in ("primary", "shadow"):
            return
        key = (str(entry.get("model", "")), str(entry.get("version") or ""))
        totals = self._totals.setdefault(key, _LedgerTotals())
        totals.requests += 1
        if "error" in entry:
            totals.errors += 1
        else:
            seconds = float(entry.get("ms", 0.0)) / 1000
            totals.latency[_bucket_of(seconds, LEDGER_LATENCY_BOUNDS_S)] += 1
            for score in entry.get("scores") or ():
                totals.scores[_bucket_of(float(score), SCORE_BOUNDS)] += 1

    def snapshot(self, model: str, *, shadow: bool = True) -> ArmSnapshot:
        self._read()
        arms = {
            version: ArmWindow(
                version=version,
                requests=t.requests,
                errors=t.errors,
                latency_bounds_s=LEDGER_LATENCY_BOUNDS_S,
                latency_buckets=tuple(t.latency),
                score_bounds=SCORE_BOUNDS,
                score_buckets=tuple(t.scores),
            )
            for (m, version), t in sorted(self._totals.items())
            if m == model and version not in NOT_ARMS
        }
        return ArmSnapshot(model, self.name, time.time(), arms)


def _prometheus_of(spec: ResolvedSpec) -> PromClient | None:
    """The mesh's Prometheus when `servemesh up` started one and it answers."""
    endpoints_file = Path(spec.state_dir) / "endpoints.json"
    try:
        endpoints = json.loads(endpoints_file.read_text())
    except (OSError, ValueError):
        return None
    address = endpoints.get("prometheus") if isinstance(endpoints, dict) else None
    if not address:
        return None
    client = PromClient(str(address))
    return client if client.ready() else None


def arm_source(spec: ResolvedSpec, *, source: Source = "auto") -> ArmSource:
    """Where the analysis reads a running mesh's counters: its Prometheus when it runs one
    (`source="auto"`, or required with "prometheus"), else the gateways' /metrics. The
    choice is made once, here: a window's two ends must come from one source."""
    if source != "endpoints":
        client = _prometheus_of(spec)
        if client is not None:
            return PrometheusSource(client, spec)
        if source == "prometheus":
            raise ArmSourceError(
                "this mesh runs no Prometheus (metrics.prometheus off, or no binary), "
                "or it does not answer"
            )
    return EndpointsSource(spec)


def windows_between(
    source: ArmSource, model: str, *, shadow: bool, before: ArmSnapshot
) -> tuple[ArmSnapshot, dict[str, ArmWindow]]:
    """A fresh snapshot and the window since `before` (a convenience for the controller)."""
    after = source.snapshot(model, shadow=shadow)
    return after, window(before, after)


def empty_arm(version: str) -> ArmWindow:
    """A version with nothing recorded in a window (it had no calls)."""
    return ArmWindow(version=version, requests=0, errors=0)


def arms_of(windows: Mapping[str, ArmWindow], versions: Iterable[str]) -> list[ArmWindow]:
    """The windows of `versions`, an empty one for a version without calls."""
    return [windows.get(v) or empty_arm(v) for v in versions]
