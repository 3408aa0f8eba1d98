"""Caller strings in error messages: quoted and cut short, by one rule everywhere.

A name, id or key a caller sent may come back in an error (so the caller sees which one
was wrong) and in the log line that records it. Unbounded, a caller could make either as
large as its message limit; quoted, a newline or control character in it cannot forge a
second log line.
"""

from __future__ import annotations

from collections.abc import Sequence

# Enough to recognise a name; every name the mesh accepts is shorter than this.
MAX_SHOWN = 64


def shown(value: str, limit: int = MAX_SHOWN) -> str:
    """`value` quoted, cut to `limit` characters ("..." marks the cut)."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def brief(value: str, limit: int = MAX_SHOWN) -> str:
    """`value` as it is when short and printable (a plain id in a list); else shown()."""
    if len(value) <= limit and value.isprintable():
        return value
    return shown(value, limit)


def brief_list(values: Sequence[str], at_most: int = 10) -> str:
    """Up to `at_most` values, each brief(), then how many more there were."""
    more = f" and {len(values) - at_most} more" if len(values) > at_most else ""
    return ", ".join(brief(v) for v in values[:at_most]) + more
