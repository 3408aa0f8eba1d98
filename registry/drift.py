"""The registry's drift round: every `prediction_log.drift.interval`, each drift reference
kept under the state dir (`servemesh drift MODEL --set-reference FILE`) is compared with its
model's live calls over `drift.window` (servemesh/predlog/references.py), and the result
exported on the registry's /metrics:

    servemesh_feature_drift_psi{model,version,feature}       PSI against the reference
    servemesh_feature_drift_p_value{model,version,feature}   the chi-square test's p-value
    servemesh_feature_drift_rows{model,version,feature}      live values compared
    servemesh_feature_drift_rounds_total{outcome}            ok | failed

`version` is the version a reference belongs to, `*` for a model's (every version's calls;
Prometheus would drop an empty label).
A feature without live values has no psi or p-value series; a reference removed takes its
series with it at the next round. The alert ServemeshFeatureDrift reads them
(servemesh/slo_rules.py, docs/runbooks/feature-drift.md).

The registry runs it because it is the one control-plane process every mesh has (one
instance, in the first zone), and the reference belongs with the versions it keeps. The
round reads the log in a thread of its own: the registry's calls never wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from servemesh.spec import MeshSpec

if TYPE_CHECKING:
    # The log's readers (DuckDB, pyarrow, scipy) load at the first round that has a
    # reference, not with the registry.
    from servemesh.predlog.drift import DriftReport

log = logging.getLogger(__name__)

Labels = tuple[str, str, str]  # model, version, feature
# The version label of a model's reference, compared with every version's calls (no
# version is named `*`).
EVERY_VERSION = "*"


class DriftMetrics:
    """The drift gauges on `registry` (the registry service's own)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        labels = ["model", "version", "feature"]
        self.psi = Gauge(
            "servemesh_feature_drift_psi",
            "PSI of the feature's live values against the model's drift reference",
            labels, registry=r,
        )  # fmt: skip
        self.p_value = Gauge(
            "servemesh_feature_drift_p_value",
            "The chi-square test's p-value: live values and reference from one distribution",
            labels, registry=r,
        )  # fmt: skip
        self.rows = Gauge(
            "servemesh_feature_drift_rows",
            "Live values of the feature compared over the drift window",
            labels, registry=r,
        )  # fmt: skip
        self.rounds = Counter(
            "servemesh_feature_drift_rounds", "Drift rounds, by outcome (ok, failed)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self._shown: set[Labels] = set()

    def publish(self, reports: list[DriftReport]) -> None:
        """The round's figures; series of features no longer compared are removed."""
        shown: set[Labels] = set()
        for report in reports:
            for feature in report.features:
                key = (report.model, report.version or EVERY_VERSION, feature.feature)
                shown.add(key)
                self.rows.labels(*key).set(feature.rows)
                for gauge, value in ((self.psi, feature.psi), (self.p_value, feature.p_value)):
                    if value is None or math.isnan(value):
                        with contextlib.suppress(KeyError):
                            gauge.remove(*key)
                    else:
                        gauge.labels(*key).set(value)
        for key in self._shown - shown:
            for gauge in (self.psi, self.p_value, self.rows):
                with contextlib.suppress(KeyError):
                    gauge.remove(*key)
        self._shown = shown


def drift_round(spec: MeshSpec, state_dir: Path) -> list[DriftReport]:
    """The drift of every referenced model the spec serves (a reference of a model no
    longer served is skipped)."""
    from servemesh.predlog.query import reader_for
    from servemesh.predlog.references import all_references, drift_report

    references = [
        r
        for r in all_references(state_dir)
        if r.model in spec.models
        and (r.version is None or r.version in spec.models[r.model].versions)
    ]
    if not references:
        return []
    reader = reader_for(spec.prediction_log, state_dir)
    settings = spec.prediction_log.drift
    return [drift_report(reader, r, settings, model=r.model, version=r.version) for r in references]


async def drift_every(current: Callable[[], MeshSpec], metrics: DriftMetrics) -> None:
    """A drift round every `prediction_log.drift.interval` of the spec `current()` gives,
    until cancelled; a failed round is logged and counted, and the next tried on time."""
    while True:
        spec = current()
        try:
            reports = await asyncio.to_thread(drift_round, spec, Path(spec.state_dir))
        except Exception as exc:  # the log's store down, a reference being replaced
            log.warning("drift round failed", extra={"error": f"{type(exc).__name__}: {exc}"[:500]})
            metrics.rounds.labels("failed").inc()
        else:
            metrics.publish(reports)
            metrics.rounds.labels("ok").inc()
        await asyncio.sleep(spec.prediction_log.drift.interval_s)
