"""The pre-deploy checklist: each item judged, one line of numbers each, and overrides.

Items (their names are what `--override ITEM` takes), judged before the rollout:

- artifact_integrity: the version's artifact, downloaded from the registry, against the
  record's size and sha256;
- offline_metrics: the record's metrics against `plan.checklist.offline_metrics`; a
  version derived by `models quantize` (its lineage names a source version and a method)
  is also held to the limits it was derived under (`derived_thresholds`) unless the plan
  sets its own for those metrics;
- rollback_target: the model's baseline (weight > 0) healthy on replicas (Envoy's checks);
- freeze: the spec's freeze windows (`freeze.py`);
- error_budget: the model's SLO budget and burn rate (`budget.py`);

and after the shadow step, on its traffic:

- shadow_latency: the canary's p99 against the SLA;
- distribution: the canary's scores present, and within `score_range`.

The judging functions here take plain values, so each is testable without a mesh; the
readers (registry, Envoy) return an item too: a source that cannot be read fails its item
with the reason, never passes it.
"""

from __future__ import annotations

import asyncio
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import grpc

from servemesh.contract.errors import ServemeshError
from servemesh.contract.wire import message_size_options
from servemesh.identity import dial_registry
from servemesh.observe.scrape import quantile
from servemesh.proxy.admin import AdminError
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_view import VersionView, live_view
from servemesh.registry.client import ArtifactIntegrityError, fetch_verified
from servemesh.registry.errors import ArtifactTooLargeError
from servemesh.rollout.types import ArmWindow, ChecklistItem
from servemesh.spec import ResolvedSpec
from servemesh.state.paths import ApplyError, MeshPaths
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc

ARTIFACT_INTEGRITY = "artifact_integrity"
OFFLINE_METRICS = "offline_metrics"
ROLLBACK_TARGET = "rollback_target"
SHADOW_LATENCY = "shadow_latency"
DISTRIBUTION = "distribution"
FREEZE = "freeze"
ERROR_BUDGET = "error_budget"
ITEMS = (
    ARTIFACT_INTEGRITY,
    OFFLINE_METRICS,
    ROLLBACK_TARGET,
    SHADOW_LATENCY,
    DISTRIBUTION,
    FREEZE,
    ERROR_BUDGET,
)
RECORD_TIMEOUT_S = 10.0
DOWNLOAD_TIMEOUT_S = 120.0


def known_items() -> tuple[str, ...]:
    """Every item name `--override` accepts."""
    return ITEMS


class OverrideError(ServemeshError, ValueError):
    """An override names no item of the checklist, or gives no reason."""


def check_overrides(overrides: Mapping[str, str]) -> None:
    """Refuse an override of an unknown item (listing the known ones) or without a reason."""
    unknown = sorted(set(overrides) - set(ITEMS))
    if unknown:
        raise OverrideError(
            f"--override: unknown item(s) {', '.join(map(repr, unknown))}; "
            f"known items: {', '.join(ITEMS)}"
        )
    blank = sorted(name for name, reason in overrides.items() if not reason.strip())
    if blank:
        raise OverrideError(
            f"--reason: overriding {', '.join(map(repr, blank))} needs a reason "
            "(it is recorded in the rollout's history)"
        )


def apply_overrides(
    items: Sequence[ChecklistItem], overrides: Mapping[str, str]
) -> list[ChecklistItem]:
    """Mark each failed item the caller overrode with its reason (it stays failed: shown as
    overridden, never as passed). Overrides of items that passed change nothing."""
    check_overrides(overrides)
    return [
        replace(item, override_reason=overrides[item.name].strip())
        if not item.ok and item.name in overrides
        else item
        for item in items
    ]


def failed(name: str, detail: str) -> ChecklistItem:
    return ChecklistItem(name=name, ok=False, detail=detail)


def passed(name: str, detail: str) -> ChecklistItem:
    return ChecklistItem(name=name, ok=True, detail=detail)


def _one_line(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(value: float) -> str:
    return f"{value:.6g}"


# --- offline metrics -----------------------------------------------------------------------

_COMPARE: dict[str, tuple[Callable[[float, float], bool], str]] = {
    ">=": (operator.ge, "<"),
    "<=": (operator.le, ">"),
    ">": (operator.gt, "<="),
    "<": (operator.lt, ">="),
}


def parse_threshold(text: str) -> tuple[str, float]:
    """ ">=0.8" -> (">=", 0.8)."""
    for symbol in (">=", "<=", ">", "<"):
        if text.startswith(symbol):
            return symbol, float(text[len(symbol) :])
    raise ValueError(f"threshold {text!r}: expected >=, <=, > or < and a number")


def derived_thresholds(lineage: Mapping[str, str]) -> dict[str, str]:
    """What a derived version's accuracy must meet: the defaults `models quantize` refuses
    beyond, so a version pushed past them by hand (or with looser flags) is stopped here
    too. Empty for a version that is not derived."""
    from servemesh.quantize import DEFAULT_MAX_ABS_ERROR, DEFAULT_MIN_AGREEMENT

    if not ("source_version" in lineage and "method" in lineage):
        return {}
    return {
        "quantize_max_abs_error": f"<={DEFAULT_MAX_ABS_ERROR}",
        "quantize_label_agreement": f">={DEFAULT_MIN_AGREEMENT}",
    }


def judge_offline_metrics(
    metrics: Mapping[str, float],
    thresholds: Mapping[str, str],
    *,
    record: str,
    lineage: Mapping[str, str] | None = None,
) -> ChecklistItem:
    """The record's metrics against every threshold of the plan (and, for a derived
    version, `derived_thresholds` the plan does not set); a metric named but missing from
    the record fails, named."""
    derived = derived_thresholds(lineage or {})
    thresholds = {**derived, **thresholds}
    if not thresholds:
        return passed(OFFLINE_METRICS, "no thresholds in the plan")
    good: list[str] = []
    bad: list[str] = []
    if derived:
        assert lineage is not None
        good.append(f"{lineage['method']} of {lineage['source_version']}")
    for name, text in sorted(thresholds.items()):
        symbol, limit = parse_threshold(text)
        if name not in metrics:
            have = ", ".join(sorted(metrics)) or "none"
            bad.append(f"{name} missing from {record}'s metrics (it has: {have})")
            continue
        value = float(metrics[name])
        holds, opposite = _COMPARE[symbol]
        if math.isfinite(value) and holds(value, limit):
            good.append(f"{name} {_number(value)} {symbol} {_number(limit)}")
        else:
            bad.append(f"{name} {_number(value)} {opposite} {_number(limit)} (needs {text})")
    if bad:
        return failed(OFFLINE_METRICS, "; ".join(bad + good))
    return passed(OFFLINE_METRICS, "; ".join(good))


# --- the registry: artifact integrity and the record's metrics ----------------------------


def _status_text(exc: grpc.aio.AioRpcError) -> str:
    code = exc.code()
    name = code.name if isinstance(code, grpc.StatusCode) else str(code)
    return f"{name}: {_one_line(exc.details() or '')}"


async def _registry_items(
    spec: ResolvedSpec, model: str, version: str, thresholds: Mapping[str, str]
) -> tuple[ChecklistItem, ChecklistItem]:
    where = f"the registry at {spec.registry_address}"
    channel = dial_registry(spec).aio_channel(
        options=message_size_options(spec.limits.max_message_bytes)
    )
    async with channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        try:
            record = await stub.GetVersion(
                registry_pb2.GetVersionRequest(model=model, version=version),
                timeout=RECORD_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as exc:
            why = f"no record of {model}/{version} from {where} ({_status_text(exc)})"
            return failed(ARTIFACT_INTEGRITY, why), failed(OFFLINE_METRICS, why)
        metrics = judge_offline_metrics(
            dict(record.metrics),
            thresholds,
            record=f"{model}/{record.version}",
            lineage=dict(record.lineage),
        )
        try:
            verified, data = await fetch_verified(
                channel, model, record.version, timeout=DOWNLOAD_TIMEOUT_S
            )
        except (ArtifactIntegrityError, ArtifactTooLargeError) as exc:
            return failed(ARTIFACT_INTEGRITY, _one_line(str(exc))), metrics
        except grpc.aio.AioRpcError as exc:
            why = f"download of {model}/{record.version} from {where} failed ({_status_text(exc)})"
            return failed(ARTIFACT_INTEGRITY, why), metrics
    if verified.sha256 != record.sha256:
        # The record changed between the two calls: the bytes match a record, not this one.
        why = f"{model}/{record.version}: the record's sha256 changed during the check"
        return failed(ARTIFACT_INTEGRITY, why), metrics
    detail = (
        f"{model}/{record.version} sha256 {record.sha256[:12]}... verified over "
        f"{len(data):,} bytes ({record.format})"
    )
    return passed(ARTIFACT_INTEGRITY, detail), metrics


def registry_items(
    spec: ResolvedSpec, model: str, version: str, thresholds: Mapping[str, str]
) -> tuple[ChecklistItem, ChecklistItem]:
    """(artifact_integrity, offline_metrics): the version's artifact downloaded through the
    registry client, which checks its size and sha256 against the record (as a model server
    does before loading it), and the record's metrics against the plan's thresholds."""
    work = _registry_items(spec, model, version, thresholds)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    # Called from a coroutine (a caller with its own loop): a loop of its own, in a thread.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, work).result()


# --- the rollback target ------------------------------------------------------------------


def judge_rollback_target(rows: Sequence[VersionView], model: str, version: str) -> ChecklistItem:
    """A version of `model` other than `version` takes traffic (weight > 0) and has healthy
    hosts, as Envoy's health checks of that version's cluster say: a replica reports a
    version healthy only once it has loaded and warmed it."""
    mine = [row for row in rows if row.model == model]
    if not mine:
        return failed(ROLLBACK_TARGET, f"model {model!r} is not served by this mesh")
    others = sorted(
        (row for row in mine if row.version != version and row.weight > 0),
        key=lambda row: -row.weight,
    )
    if not others:
        weights = ", ".join(f"{row.version} {row.weight}" for row in mine)
        return failed(
            ROLLBACK_TARGET,
            f"no version of {model} but {version} takes traffic (weights: {weights}): "
            "nothing to roll back to",
        )
    target = others[0]
    healthy, hosts = sum(target.healthy.values()), sum(target.hosts.values())
    zones = ", ".join(
        f"{zone} {target.healthy.get(zone, 0)}/{count}"
        for zone, count in sorted(target.hosts.items())
    )
    if healthy == 0:
        return failed(
            ROLLBACK_TARGET,
            f"{model} {target.version} (weight {target.weight}) has no healthy host "
            f"({healthy} of {hosts}{'; ' + zones if zones else ''})",
        )
    return passed(
        ROLLBACK_TARGET,
        f"{model} {target.version} (weight {target.weight}) healthy on {healthy} of {hosts} "
        f"hosts ({zones})",
    )


def rollback_target_item(spec: ResolvedSpec, model: str, version: str) -> ChecklistItem:
    """judge_rollback_target on what Envoy serves now (its admin API)."""
    try:
        manager = RouteManager(MeshPaths(Path(spec.state_dir)))
        live = manager.live_spec()
        rows = live_view(manager.admins(live), live)
    except (ApplyError, AdminError, OSError, KeyError, ValueError) as exc:
        return failed(ROLLBACK_TARGET, f"cannot read what Envoy serves: {_one_line(str(exc))}")
    return judge_rollback_target(rows, model, version)


# --- shadow traffic: latency and the distribution of scores -------------------------------


def p99_ms(window: ArmWindow) -> float:
    """The window's p99 latency in ms, interpolated inside its bucket as PromQL's
    histogram_quantile does; NaN without observations."""
    cumulative: dict[float, float] = {}
    running = 0
    for bound, count in zip(window.latency_bounds_s, window.latency_buckets, strict=True):
        running += count
        cumulative[bound] = running
    return quantile(0.99, cumulative) * 1000.0


def judge_shadow_latency(
    windows: Mapping[str, ArmWindow],
    baseline: str,
    canary: str,
    limit_ms: float | None,
    limit_source: str,
) -> ChecklistItem:
    """The canary's p99 on shadow traffic within `limit_ms` (the plan's shadow_p99_ms, or
    the model's SLO p99: `limit_source` says which)."""
    arm = windows.get(canary)
    if arm is None or sum(arm.latency_buckets) == 0:
        return failed(SHADOW_LATENCY, f"no shadow call timed for {canary}: nothing to judge")
    p99 = p99_ms(arm)
    base = windows.get(baseline)
    versus = ""
    if base is not None and sum(base.latency_buckets) > 0:
        versus = f" (baseline {baseline} {p99_ms(base):.1f} ms)"
    timed = sum(arm.latency_buckets)
    if limit_ms is None:
        return passed(
            SHADOW_LATENCY,
            f"{canary} p99 {p99:.1f} ms over {timed:,} shadow calls{versus}; no SLA to judge "
            "it by (neither checklist.shadow_p99_ms nor an SLO for the model)",
        )
    numbers = f"{canary} p99 {p99:.1f} ms over {timed:,} shadow calls{versus}"
    if math.isnan(p99) or p99 > limit_ms:
        return failed(SHADOW_LATENCY, f"{numbers} > {limit_ms:g} ms ({limit_source})")
    return passed(SHADOW_LATENCY, f"{numbers} <= {limit_ms:g} ms ({limit_source})")


def _bucket_ranges(bounds: Sequence[float]) -> list[tuple[float, float]]:
    """Each bucket as (lower, upper]: the first from -inf, the last to its bound (+inf)."""
    lowers = [-math.inf, *bounds[:-1]]
    return list(zip(lowers, bounds, strict=True))


def judge_distribution(
    windows: Mapping[str, ArmWindow], canary: str, score_range: tuple[float, float] | None
) -> ChecklistItem:
    """The canary answered scores on shadow traffic, and (with `score_range`) none lie in a
    bucket wholly outside the range. A histogram places a score only to its bucket: a bucket
    that straddles an end of the range counts as inside (the detail says the resolution).
    Infinite scores land in the open-ended buckets, which lie outside any finite range; a NaN
    falls in no bucket at all, so it shows only as a score missing from the histogram."""
    arm = windows.get(canary)
    total = sum(arm.score_buckets) if arm is not None else 0
    if arm is None or total == 0:
        return failed(DISTRIBUTION, f"no score recorded for {canary} on shadow traffic")
    if score_range is None:
        return passed(
            DISTRIBUTION,
            f"{total:,} scores from {canary} on shadow traffic; no score_range in the plan",
        )
    low, high = score_range
    outside = 0
    for (lower, upper), count in zip(
        _bucket_ranges(arm.score_bounds), arm.score_buckets, strict=True
    ):
        if count and (upper < low or lower >= high):
            outside += count
    finite = [b for b in arm.score_bounds if math.isfinite(b)]
    resolution = f"buckets {finite[0]:g}..{finite[-1]:g}" if finite else "one bucket"
    where = f"[{low:g}, {high:g}]"
    if outside:
        return failed(
            DISTRIBUTION,
            f"{outside:,} of {total:,} {canary} scores outside {where} (by histogram {resolution})",
        )
    return passed(
        DISTRIBUTION,
        f"all {total:,} {canary} scores within {where} (by histogram {resolution})",
    )
