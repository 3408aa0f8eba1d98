"""Checks on rows bound for the online store, shared by the file loader and the service.

Each check looks at a whole batch at once (numpy) and returns the problems it found, each
naming the row by its position in the batch and the column; `Problem.at` turns that into
the file's own words ("line 57", "row 55") for the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Entity ids longer than this are refused (they are part of every Redis key).
MAX_ID_LENGTH = 256
# Event times further ahead than this are refused: most likely milliseconds read as seconds.
FUTURE_SLACK_MS = 24 * 3600 * 1000
# The largest float32: values beyond it cannot be stored.
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Problem:
    """One bad cell or row: its position in the batch, the column, what is wrong."""

    row: int
    column: str
    message: str

    def at(self, label: str, first: int) -> str:
        """The problem in the file's words: `line 57: amount: not a number`."""
        return f"{label} {first + self.row}: {self.column}: {self.message}"


def check_ids(entity_ids: Sequence[str | None], column: str, limit: int = 20) -> list[Problem]:
    """Empty, missing or overlong keys."""
    found: list[Problem] = []
    for i, entity_id in enumerate(entity_ids):
        if not entity_id:
            found.append(Problem(i, column, "empty key"))
        elif len(entity_id) > MAX_ID_LENGTH:
            found.append(Problem(i, column, f"key longer than {MAX_ID_LENGTH} characters"))
        if len(found) >= limit:
            break
    return found


def check_values(
    values: np.ndarray, features: Sequence[str], allow_nan: bool, limit: int = 20
) -> list[Problem]:
    """Infinities, NaN where the view forbids it, and numbers too large for float32."""
    bad = np.isinf(values) if allow_nan else ~np.isfinite(values)
    bad |= np.abs(values) > FLOAT32_MAX  # False for NaN
    if not bad.any():
        return []
    found: list[Problem] = []
    for row, col in np.argwhere(bad)[:limit]:
        value = float(values[row, col])
        if np.isnan(value):
            message = "NaN (empty or NaN cell), and the view does not allow NaN"
        elif np.isinf(value):
            message = f"{value} is not a finite number"
        else:
            message = f"{value!r} does not fit a float32"
        found.append(Problem(int(row), features[int(col)], message))
    return found


def check_event_times(
    event_ms: np.ndarray, now_ms: int, column: str, limit: int = 20
) -> list[Problem]:
    """Event times more than a day ahead of now."""
    ahead = np.flatnonzero(event_ms > now_ms + FUTURE_SLACK_MS)
    return [
        Problem(
            int(i),
            column,
            f"{int(event_ms[i])} ms since the epoch is more than a day in the future "
            "(numbers are read as seconds since the Unix epoch)",
        )
        for i in ahead[:limit]
    ]


def format_age(ms: int) -> str:
    """A short human duration: 45s, 12m 5s, 26h 3m, 3d 4h."""
    seconds = max(0, ms) // 1000
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{seconds}s" if seconds else f"{max(0, ms)}ms"
