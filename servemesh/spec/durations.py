"""Durations as the spec writes them: "90s", "15m", "24h", "7d", "1h30m" (ms, s, m, h, d)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

Duration = Annotated[str, Field(pattern=r"^(\d+(ms|s|m|h|d))+$")]
_DURATION_PART = re.compile(r"(\d+)(ms|s|m|h|d)")
_DURATION_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration_seconds(text: str) -> float:
    """Seconds in a Duration ("1h30m" is 5400.0)."""
    return sum(int(n) * _DURATION_UNIT_S[unit] for n, unit in _DURATION_PART.findall(text))
