"""Work the mesh runs beside serving requests: streaming predictions (`streams:`) and
scheduled batch runs (`batch:`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from servemesh.spec.base import Name, _Strict
from servemesh.spec.durations import Duration

# A Redis stream key (a consumer reads one and writes two).
StreamKey = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9:._{}-]{0,199}$")]


class StreamSpec(_Strict):
    """One streaming prediction: a consumer group reading events from a Redis stream,
    writing one prediction per event to an output stream (`servemesh stream`,
    docs/serving-patterns.md). Delivery is at least once with an idempotent effect: an
    event is acknowledged only after its prediction is written, and a redelivered event
    never adds a second output entry."""

    name: Name
    # The model that scores each event; `version` pins one (through the mesh, a pin at 0%
    # of traffic is refused unless the caller is an operator); null: the routes decide
    # (mesh), or the version with the most traffic (in_process).
    model: Name
    version: Name | None = None
    # mesh: each batch is one Predict through the edge (routing, canaries, deadlines and
    # the prediction log apply); in_process: the consumer loads the registry's verified
    # artifact itself and reads the views straight from the feature store.
    mode: Literal["mesh", "in_process"] = "mesh"
    # The stream keys; null: streams:<name>:in, :out and :dead.
    input: StreamKey | None = None
    output: StreamKey | None = None
    dead_letter: StreamKey | None = None
    group: Name = "servemesh"
    # Where the streams live; null: the mesh's own Redis (feature_store.redis_url).
    redis_url: str | None = None
    # A file whose first line is that Redis's password (with redis_url).
    password_file: str | None = None
    # A new group starts at the stream's first entry (earliest) or at its end (latest).
    start: Literal["earliest", "latest"] = "earliest"
    # Events read (and scored) per batch, and how long a read waits for one.
    batch_size: Annotated[int, Field(ge=1, le=10_000)] = 64
    block_ms: Annotated[int, Field(ge=1, le=60_000)] = 100
    # Another consumer's pending entry idle this long is taken over (a consumer that died).
    claim_min_idle: Duration = "30s"
    # How long the marker that an event's prediction was written is kept: a redelivery
    # later than this would write a second output entry.
    dedup_ttl: Duration = "1d"
    # The deadline of each Predict (mesh) or batch (in_process).
    deadline_ms: Annotated[float, Field(gt=0, le=600_000)] = 2000.0
    # The output and dead-letter streams are trimmed to about this many entries.
    max_output_entries: Annotated[int, Field(ge=1000, le=1_000_000_000)] = 1_000_000

    @property
    def input_key(self) -> str:
        return self.input or f"streams:{self.name}:in"

    @property
    def output_key(self) -> str:
        return self.output or f"streams:{self.name}:out"

    @property
    def dead_letter_key(self) -> str:
        return self.dead_letter or f"streams:{self.name}:dead"


# The cron macros a batch job's schedule may be (else five fields: minute hour day month
# weekday, in UTC).
CRON_MACROS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")


class BatchJobSpec(_Strict):
    """One scheduled batch run: `servemesh batch score` with these arguments, run when its
    cron `schedule` (UTC) comes round, by `servemesh batch run-due` or by `servemesh up`
    (docs/batch.md)."""

    name: Name
    model: Name
    # The model version, or a registry alias naming one; neither: the version most traffic
    # goes to when the job runs.
    version: Name | None = None
    alias: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    # Score every entity of this view (default: the model's first), or the ids in this CSV
    # or Parquet file (relative paths: to the directory the command runs in).
    view: Name | None = None
    entities: Annotated[str, Field(min_length=1)] | None = None
    entity_column: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    # FILE.parquet, redis (the mesh's own, docs/batch.md's key layout) or postgresql://...
    output: Annotated[str, Field(min_length=1)]
    # The PostgreSQL table (default <model>_scores).
    table: Annotated[str, Field(min_length=1, max_length=63)] | None = None
    chunk_rows: Annotated[int, Field(ge=1, le=65_536)] = 1024
    # Score only rows that pass, e.g. "event_ts > 2024-05-01 and f03 >= 0.5".
    where: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    # Cron, five fields (minute hour day-of-month month day-of-week) or a macro (@daily).
    schedule: str
    # torch intra-op threads for the run (null: torch's default).
    threads: Annotated[int, Field(ge=1, le=1024)] | None = None

    @field_validator("schedule")
    @classmethod
    def _cron(cls, schedule: str) -> str:
        from croniter import croniter

        text = " ".join(schedule.split())
        if not text.startswith("@") and len(text.split()) != 5:
            raise ValueError(
                f"{schedule!r}: five cron fields (minute hour day month weekday) or one of "
                f"{', '.join(CRON_MACROS)}"
            )
        if text.startswith("@") and text not in CRON_MACROS:
            raise ValueError(f"{schedule!r}: not one of {', '.join(CRON_MACROS)}")
        if not croniter.is_valid(text):
            raise ValueError(f"{schedule!r}: not a valid cron expression")
        return text

    @model_validator(mode="after")
    def _one_of_each(self) -> BatchJobSpec:
        if self.version is not None and self.alias is not None:
            raise ValueError("version, alias: give one, not both")
        if self.view is not None and self.entities is not None:
            raise ValueError("view, entities: give one, not both")
        postgres = self.output.startswith(("postgresql://", "postgres://"))
        if (
            not postgres
            and self.output != "redis"
            and not self.output.endswith((".parquet", ".pq"))
        ):
            raise ValueError(
                f"output: {self.output!r} is not a .parquet file, redis or postgresql://"
            )
        if self.table is not None and not postgres:
            raise ValueError("table: only with a postgresql:// output")
        if self.entity_column is not None and self.entities is None:
            raise ValueError("entity_column: only with entities")
        return self
