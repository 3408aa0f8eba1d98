"""Drift of a model's live inputs against a reference: per feature, how far the values its
calls sent lately moved from those of a reference sample (a version's training data).

A reference is kept summarised, never as rows (`summarise`): for a numeric feature the
edges of its deciles and the sample's count in each bin (with its mean and spread); for a
categorical one (text, booleans, or a column named categorical) its most frequent
categories' counts and the rest's. The live side is the prediction log's kept values
(`log_features: true`) over a window, binned the same way (`compare`):

- PSI, the population stability index (servemesh/contract/psi.py, the rollout analysis's
  own): on the reference's decile bins for a numeric feature, on the category shares for a
  categorical one. 0 for the same shares; 0.1 a shift worth a look; 0.2 a large one.
- a chi-square test of homogeneity on the same bins (scipy.stats.chi2_contingency): how
  likely two samples of one distribution differ this much. The reference is a sample too,
  not the truth, so the two-sample test fits where a goodness-of-fit test against its shares
  (scipy.stats.chisquare) would treat them as exact.

A feature drifts when its PSI reaches `psi_drifting` and the test's p-value is under
`p_value` (the spec's `prediction_log.drift`): PSI says the shift is large, the test that
it is not the noise of a small sample. Why not evidently's presets: they take the reference
as a whole DataFrame of rows (the summary here keeps the training data out of the state
dir), pull in pandas, plotly and more for two statistics scipy computes, and the same PSI
already judges canaries here.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from servemesh.contract.psi import psi
from servemesh.spec import DriftSpec

# Reference bins of a numeric feature: deciles (fewer where values repeat).
BINS = 10
# Categories a reference keeps by name; the rest are counted together as "(other)".
MAX_CATEGORIES = 50
OTHER = "(other)"
# Every bin (category) is PSI's own, but one holding less than a tenth of one sample's
# even share (both samples' shares added) joins its thinner neighbour: a few outliers in a
# bin the reference left empty would otherwise weigh ln(share / PSI_EPSILON) each.
FLOOR_DIVISOR = 10
Verdict = Literal["ok", "watch", "drifting", "too few rows", "no values"]


class NumericSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["numeric"] = "numeric"
    # The bins' inner edges, ascending: bin i holds values in (edges[i-1], edges[i]].
    edges: list[float]
    counts: list[int]  # the reference's values per bin, len(edges) + 1
    mean: float
    std: float
    missing: int = 0  # null or NaN in the reference


class CategoricalSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["categorical"] = "categorical"
    categories: list[str]  # the most frequent, most first
    counts: list[int]  # per category
    other: int = 0  # the reference's values in no kept category
    missing: int = 0


FeatureSummary = NumericSummary | CategoricalSummary


class Reference(BaseModel):
    """A model's (or one version's) reference, summarised: what the state dir keeps."""

    model_config = ConfigDict(extra="forbid")

    model: str
    version: str | None = None  # None: every version of the model
    source: str  # the file it was summarised from, as given
    created: str  # when, UTC ISO 8601
    rows: int
    features: dict[str, NumericSummary | CategoricalSummary] = Field(default_factory=dict)


def category_key(value: Any) -> str | None:
    """A value as a category: the same text for a reference's 3 (int64) and a live 3.0
    (JSON). None for a missing value."""
    if value is None:
        return None
    if isinstance(value, bool | np.bool_):
        return "true" if value else "false"
    if isinstance(value, int | np.integer):
        return str(int(value))
    if isinstance(value, float | np.floating):
        if math.isnan(value):
            return None
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    return str(value)


def summarise_numeric(values: np.ndarray, bins: int = BINS) -> NumericSummary:
    """Decile edges (fewer where values repeat) and the sample's count per bin."""
    data = np.asarray(values, dtype=np.float64)
    finite = data[np.isfinite(data)]
    missing = int(data.size - finite.size)
    if finite.size == 0:
        return NumericSummary(edges=[], counts=[0], mean=math.nan, std=math.nan, missing=missing)
    # Edges are values the sample holds (not interpolated between two): a feature of few
    # distinct values gets a bin per value.
    quantiles = np.quantile(finite, [i / bins for i in range(1, bins)], method="inverted_cdf")
    edges = [float(e) for e in np.unique(quantiles)]
    counts = np.bincount(np.searchsorted(edges, finite, side="left"), minlength=len(edges) + 1)
    return NumericSummary(
        edges=edges,
        counts=[int(c) for c in counts],
        mean=float(finite.mean()),
        std=float(finite.std()),
        missing=missing,
    )


def summarise_categorical(
    values: Iterable[Any], max_categories: int = MAX_CATEGORIES
) -> CategoricalSummary:
    """The most frequent categories' counts (ties by name), the rest together."""
    counted: Counter[str] = Counter()
    missing = 0
    for value in values:
        key = category_key(value)
        if key is None:
            missing += 1
        else:
            counted[key] += 1
    ranked = sorted(counted.items(), key=lambda kv: (-kv[1], kv[0]))
    kept = ranked[:max_categories]
    return CategoricalSummary(
        categories=[k for k, _ in kept],
        counts=[n for _, n in kept],
        other=sum(n for _, n in ranked[max_categories:]),
        missing=missing,
    )


# --- comparing -------------------------------------------------------------------------


@dataclass(frozen=True)
class FeatureDrift:
    feature: str
    kind: Literal["numeric", "categorical"]
    rows: int  # live values compared
    psi: float | None  # None: no values to compare
    p_value: float | None
    bins: int  # bins (categories) the test compared
    verdict: Verdict
    # What moved, readably: the mean for a numeric feature, the category whose share moved
    # most for a categorical one ("gold 12% -> 40%").
    detail: str = ""


def verdict_of(
    psi_value: float | None, p_value: float | None, rows: int, drift: DriftSpec
) -> Verdict:
    """The documented verdict: `drifting` needs both a large PSI and a small p-value."""
    if rows == 0 or psi_value is None:
        return "no values"
    if rows < drift.min_rows:
        return "too few rows"
    if psi_value >= drift.psi_drifting and p_value is not None and p_value < drift.p_value:
        return "drifting"
    if psi_value >= drift.psi_watch:
        return "watch"
    return "ok"


def chi2_p_value(reference: Sequence[int], live: Sequence[int]) -> float:
    """The chi-square test of homogeneity of two samples' counts over the same bins (bins
    neither sample fills left out); 1.0 when fewer than two bins remain."""
    from scipy.stats import chi2_contingency  # type: ignore[import-untyped]

    kept = [(r, n) for r, n in zip(reference, live, strict=True) if r or n]
    if len(kept) < 2 or not sum(r for r, _ in kept) or not sum(n for _, n in kept):
        return 1.0
    table = np.array([[r for r, _ in kept], [n for _, n in kept]], dtype=np.float64)
    result = chi2_contingency(table, correction=False)
    return float(result.pvalue)


def _numbers(values: Iterable[Any]) -> np.ndarray:
    found = [
        float(v)
        for v in values
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ]
    return np.asarray(found, dtype=np.float64)


def compare_numeric(
    name: str, summary: NumericSummary, values: Iterable[Any], drift: DriftSpec
) -> FeatureDrift:
    live = _numbers(values)
    rows = int(live.size)
    if rows == 0 or not sum(summary.counts):
        return FeatureDrift(name, "numeric", rows, None, None, 0, "no values")
    counts = np.bincount(
        np.searchsorted(summary.edges, live, side="left"), minlength=len(summary.edges) + 1
    )
    live_counts = [int(c) for c in counts]
    found = psi(summary.counts, live_counts, max_bins=FLOOR_DIVISOR * len(live_counts))
    p_value = chi2_p_value(summary.counts, live_counts)
    detail = f"mean {summary.mean:.3g} -> {float(live.mean()):.3g}"
    return FeatureDrift(
        name,
        "numeric",
        rows,
        found.value,
        p_value,
        found.bins,
        verdict_of(found.value, p_value, rows, drift),
        detail,
    )


def compare_categorical(
    name: str, summary: CategoricalSummary, values: Iterable[Any], drift: DriftSpec
) -> FeatureDrift:
    index = {c: i for i, c in enumerate(summary.categories)}
    live_counts = [0] * (len(summary.categories) + 1)  # the last: categories not kept
    rows = 0
    for value in values:
        key = category_key(value)
        if key is None:
            continue
        live_counts[index.get(key, len(summary.categories))] += 1
        rows += 1
    reference = [*summary.counts, summary.other]
    if rows == 0 or not sum(reference):
        return FeatureDrift(name, "categorical", rows, None, None, 0, "no values")
    found = psi(reference, live_counts, max_bins=FLOOR_DIVISOR * len(reference))
    p_value = chi2_p_value(reference, live_counts)
    return FeatureDrift(
        name,
        "categorical",
        rows,
        found.value,
        p_value,
        found.bins,
        verdict_of(found.value, p_value, rows, drift),
        _moved_most([*summary.categories, OTHER], reference, live_counts),
    )


def _moved_most(names: Sequence[str], reference: Sequence[int], live: Sequence[int]) -> str:
    total_r, total_l = sum(reference), sum(live)
    shares = [(r / total_r, n / total_l) for r, n in zip(reference, live, strict=True)]
    i = max(range(len(shares)), key=lambda j: abs(shares[j][1] - shares[j][0]))
    before, after = shares[i]
    return f"{names[i]} {before:.0%} -> {after:.0%}"


def compare(
    reference: Reference, values: Mapping[str, Sequence[Any]], drift: DriftSpec
) -> list[FeatureDrift]:
    """Each reference feature against the live values of the same name, in the
    reference's order."""
    found = []
    for name, summary in reference.features.items():
        live = values.get(name, ())
        if isinstance(summary, NumericSummary):
            found.append(compare_numeric(name, summary, live, drift))
        else:
            found.append(compare_categorical(name, summary, live, drift))
    return found


def gather(records: Iterable[Mapping[str, Sequence[Any]]]) -> dict[str, list[Any]]:
    """The values of many records (each a list per feature), concatenated per feature."""
    found: dict[str, list[Any]] = {}
    for record in records:
        for name, values in record.items():
            found.setdefault(name, []).extend(values)
    return found


@dataclass(frozen=True)
class DriftReport:
    """One model's (or version's) drift over a window, as `servemesh drift` prints it."""

    model: str
    version: str | None  # None: every version's calls
    window_s: float
    reference: Reference
    calls: int  # the model's calls in the window
    with_values: int  # of which the log kept the feature values
    read: int  # of which were read (at most drift.max_records, newest first)
    features: list[FeatureDrift] = field(default_factory=list)

    @property
    def drifting(self) -> list[str]:
        return [f.feature for f in self.features if f.verdict == "drifting"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "window_s": self.window_s,
            "reference": {
                "source": self.reference.source,
                "version": self.reference.version,
                "created": self.reference.created,
                "rows": self.reference.rows,
            },
            "calls": self.calls,
            "calls_with_values": self.with_values,
            "calls_read": self.read,
            "features": [
                {
                    "feature": f.feature,
                    "kind": f.kind,
                    "rows": f.rows,
                    "psi": _finite(f.psi),
                    "p_value": _finite(f.p_value),
                    "bins": f.bins,
                    "verdict": f.verdict,
                    "detail": f.detail,
                }
                for f in self.features
            ],
            "drifting": self.drifting,
        }


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 6)
