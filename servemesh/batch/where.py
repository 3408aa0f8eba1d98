"""`--where`: which rows of a run are scored, by their event time and feature values.

    event_ts > 2024-05-01T00:00:00Z and f03 >= 0.5

Clauses are `NAME OP VALUE` joined by `and`; NAME is `event_ts` (the row's event time:
an ISO 8601 time or seconds since the Unix epoch) or a feature of the view the run reads;
OP is one of `>`, `>=`, `<`, `<=`, `=`, `!=`. Nothing else is evaluated: no expressions,
no code. A comparison with NaN is false, as in SQL.
"""

from __future__ import annotations

import datetime
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from servemesh.batch.errors import BatchError

EVENT_TIME = "event_ts"
_OPS: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
    "=": operator.eq,
    "==": operator.eq,
}
_CLAUSE = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(>=|<=|!=|==|=|>|<)\s*(.+?)\s*$")
_AND = re.compile(r"\s+and\s+", re.IGNORECASE)


@dataclass(frozen=True)
class Clause:
    name: str
    op: str
    value: float  # event_ts: milliseconds since the Unix epoch


@dataclass(frozen=True)
class Where:
    text: str
    clauses: tuple[Clause, ...]

    @property
    def features(self) -> list[str]:
        return [c.name for c in self.clauses if c.name != EVENT_TIME]

    def mask(self, event_ms: np.ndarray, columns: Mapping[str, np.ndarray]) -> np.ndarray:
        """True for the rows every clause keeps."""
        keep = np.ones(len(event_ms), dtype=bool)
        for clause in self.clauses:
            values = event_ms if clause.name == EVENT_TIME else columns[clause.name]
            keep &= _OPS[clause.op](values, clause.value)
        return keep


def parse_where(text: str, features: Sequence[str]) -> Where:
    """The filter `text` says; BatchError naming the clause that is not one."""
    clauses = []
    for part in _AND.split(text.strip()):
        found = _CLAUSE.match(part)
        if not found:
            raise BatchError(f"--where: {part!r} is not NAME OP VALUE (OP: > >= < <= = !=)")
        name, op, raw = found.groups()
        raw = raw.strip("'\"")
        if name == EVENT_TIME:
            value = float(_time_ms(raw))
        elif name in features:
            try:
                value = float(raw)
            except ValueError:
                raise BatchError(f"--where: {part!r}: {raw!r} is not a number") from None
        else:
            raise BatchError(
                f"--where: {name!r} is neither {EVENT_TIME} nor a feature of the view "
                f"({', '.join(list(features)[:8])}{', ...' if len(features) > 8 else ''})"
            )
        clauses.append(Clause(name, op, value))
    return Where(text, tuple(clauses))


def _time_ms(raw: str) -> int:
    try:
        return round(float(raw) * 1000)
    except ValueError:
        pass
    try:
        when = datetime.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise BatchError(
            f"--where: {EVENT_TIME}: {raw!r} is not an ISO 8601 time or epoch seconds"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return round(when.timestamp() * 1000)
