"""A caller's forced trace: a W3C `traceparent` with the sampled flag set."""

from __future__ import annotations

import secrets


def new_traceparent() -> tuple[str, str]:
    """A W3C `traceparent` with the sampled flag set, and its trace id: a caller forcing a
    trace (the mesh's sampling is parent-based, so every hop records it)."""
    trace_id = secrets.token_hex(16)
    return f"00-{trace_id}-{secrets.token_hex(8)}-01", trace_id
