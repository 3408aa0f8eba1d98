"""Compare a shadow version with the primary from what both sides' replicas recorded."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servemesh.load import percentile


@dataclass(frozen=True)
class ShadowReport:
    model: str
    pairs: int
    agreeing: int
    tolerance: float
    primary_only: int
    shadow_only: int
    shadow_errors: int
    primary_versions: dict[str, int]
    shadow_versions: dict[str, int]
    primary_p50_ms: float
    primary_p99_ms: float
    shadow_p50_ms: float
    shadow_p99_ms: float
    mean_abs_diff: float

    @property
    def agreement(self) -> float:
        return self.agreeing / self.pairs if self.pairs else float("nan")


def _entries(folder: Path, model: str) -> list[dict[str, Any]]:
    found = []
    for path in sorted(folder.glob("*.jsonl*")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if entry.get("model") == model:
                found.append(entry)
    return found


def shadow_report(folder: Path, model: str, tolerance: float = 1e-3) -> ShadowReport:
    """Pair primary and shadow answers by request id; scores agree when every one is
    within `tolerance` of its counterpart."""
    primary: dict[str, dict[str, Any]] = {}
    shadow: dict[str, dict[str, Any]] = {}
    for entry in _entries(folder, model):
        side = primary if entry.get("role") == "primary" else shadow
        side[str(entry.get("request_id", ""))] = entry
    paired = sorted(set(primary) & set(shadow))
    agreeing, diffs = 0, []
    for request_id in paired:
        a, b = primary[request_id].get("scores"), shadow[request_id].get("scores")
        if not a or not b or len(a) != len(b):
            continue
        worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
        diffs.append(worst)
        agreeing += worst <= tolerance

    def versions(side: dict[str, dict[str, Any]]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for entry in side.values():
            key = "error" if "error" in entry else entry.get("version") or "error"
            counts[key] = counts.get(key, 0) + 1
        return counts

    def ms(side: dict[str, dict[str, Any]]) -> list[float]:
        return [float(e["ms"]) for e in side.values() if "error" not in e]

    return ShadowReport(
        model=model,
        pairs=len(paired),
        agreeing=agreeing,
        tolerance=tolerance,
        primary_only=len(set(primary) - set(shadow)),
        shadow_only=len(set(shadow) - set(primary)),
        shadow_errors=sum("error" in e for e in shadow.values()),
        primary_versions=versions(primary),
        shadow_versions=versions(shadow),
        primary_p50_ms=percentile(ms(primary), 50),
        primary_p99_ms=percentile(ms(primary), 99),
        shadow_p50_ms=percentile(ms(shadow), 50),
        shadow_p99_ms=percentile(ms(shadow), 99),
        mean_abs_diff=statistics.fmean(diffs) if diffs else float("nan"),
    )
