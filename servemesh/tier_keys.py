"""Where the gateway's tiers find what they read in the feature store's Redis.

Precomputed answers are the output of `servemesh batch score --out redis` (docs/batch.md,
"Redis layout"): `<prefix>.scores:<model>:<version>:current` names the run readers read,
`...@<run>` its hash (sha256, scored_at_ms), `...@<run>:<entity>` each entity's answer.
`<prefix>.tiers:<model>:flush` is the model's flush generation: `servemesh cache flush M`
raises it, and a gateway drops its cached answers of M when it sees a new one.
"""

from __future__ import annotations


def scores_base(key_prefix: str, model: str, version: str) -> str:
    """The keys of one model version's batch output (as servemesh.batch.writers writes them)."""
    return f"{key_prefix}.scores:{model}:{version}"


def flush_key(key_prefix: str, model: str) -> str:
    """The model's flush generation (INCR); a view's keys never have a dot, so never met."""
    return f"{key_prefix}.tiers:{model}:flush"
