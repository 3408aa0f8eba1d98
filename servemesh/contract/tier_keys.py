"""The Redis key layout of the tiers: the only module that spells it.

Precomputed answers are the output of `servemesh batch score --out redis` (docs/batch.md,
"Redis layout"), written by servemesh/batch/writers.py and read by the feature service
(services/feature/store.py) for the gateway's precomputed tier. `<p>` is the feature
store's key prefix followed by `.scores` (`fs.scores`: never a view's key, whose names
have no dot):

| key | type | what |
| --- | --- | --- |
| `<p>:<model>:<version>:current` | string | the run number readers read |
| `<p>:<model>:<version>:seq` | string | the last run number handed out (INCR) |
| `<p>:<model>:<version>:runs` | set | run numbers whose keys may exist |
| `<p>:<model>:<version>@<run>` | hash | model, version, sha256, rows, outputs (JSON list), source, started_at_ms, scored_at_ms (set when in place) |
| `<p>:<model>:<version>@<run>:<entity>` | string | JSON: `{"outputs": {"score": [0.73]}, "scored_at_ms": 1714564800000}` |

`<prefix>.tiers:<model>:flush` is the model's flush generation: `servemesh cache flush M`
raises it, and a gateway drops its cached answers of M when it sees a new one. The change
feed (services/feature/changes.py) watches the flush keys and the run pointers.
"""  # noqa: E501

from __future__ import annotations

from dataclasses import dataclass

SCORES = ".scores"  # after the store's key prefix: a model version's batch output
TIERS = ".tiers"  # after the store's key prefix: a model's tier state (its flush generation)
_GLOB_SPECIALS = str.maketrans({c: f"\\{c}" for c in "*?[]\\"})


@dataclass(frozen=True)
class ScoreKeys:
    """The keys of one model version's batch output."""

    base: str  # `<prefix>.scores:<model>:<version>`

    @property
    def current(self) -> str:
        """The run readers read (a pointer, flipped when a run is in place)."""
        return f"{self.base}:current"

    @property
    def seq(self) -> str:
        """The last run number handed out (INCR)."""
        return f"{self.base}:seq"

    @property
    def runs(self) -> str:
        """The run numbers whose keys may exist."""
        return f"{self.base}:runs"

    def run(self, run: int) -> str:
        """The run's hash (sha256, rows, scored_at_ms, ...)."""
        return f"{self.base}@{run}"

    def answer(self, run: int, entity: str) -> str:
        """One entity's stored answer in `run`."""
        return f"{self.run(run)}:{entity}"

    def answers_pattern(self, run: int) -> str:
        """A SCAN pattern matching every entity answer of `run` (and nothing else)."""
        return f"{self.run(run).translate(_GLOB_SPECIALS)}:*"


def scores_prefix(key_prefix: str) -> str:
    """Where every model's batch output lives under the store's key prefix."""
    return f"{key_prefix}{SCORES}"


def score_keys(key_prefix: str, model: str, version: str) -> ScoreKeys:
    """The keys of one model version's batch output."""
    return ScoreKeys(scores_base(key_prefix, model, version))


def scores_base(key_prefix: str, model: str, version: str) -> str:
    """The keys of one model version's batch output (as servemesh.batch.writers writes them)."""
    return f"{scores_prefix(key_prefix)}:{model}:{version}"


def flush_key(key_prefix: str, model: str) -> str:
    """The model's flush generation (INCR); a view's keys never have a dot, so never met."""
    return f"{key_prefix}{TIERS}:{model}:flush"


def watched_patterns(key_prefix: str) -> list[str]:
    """Glob patterns of the tier keys whose writes a gateway's cache cares about: every flush
    generation and every run pointer."""
    return [f"{key_prefix}{TIERS}:*", f"{scores_prefix(key_prefix)}:*:current"]


def model_of(key: str, key_prefix: str) -> str | None:
    """The model whose flush generation or run pointer `key` is; None for any other key."""
    flushes = f"{key_prefix}{TIERS}:"
    if key.startswith(flushes) and key.endswith(":flush"):
        model = key[len(flushes) : -len(":flush")]
        return model if key == flush_key(key_prefix, model) else None
    scores = f"{scores_prefix(key_prefix)}:"
    if key.startswith(scores) and key.endswith(":current"):
        parts = key[len(scores) : -len(":current")].split(":")
        if len(parts) == 2 and key == score_keys(key_prefix, *parts).current:
            return parts[0]
    return None
