"""The gateway's prediction log, as the spec describes it."""

from __future__ import annotations

from pathlib import Path

from servemesh.predlog.buffer import (
    STATUS_FILE,
    PredictionLog,
    Store,
    entity_names,
    logged_features,
    predictions_dir,
)
from servemesh.predlog.parquet_store import ParquetStore
from servemesh.predlog.record import RowContext
from servemesh.spec import MeshSpec, PredictionLogSpec


def open_store(settings: PredictionLogSpec, state_dir: str | Path, instance: str) -> Store:
    """PostgreSQL when the spec names a DSN, else Parquet files under the state dir. Opens
    no connection: the writer thread connects at its first batch."""
    dsn = settings.dsn()
    if dsn is not None:
        # psycopg loads only for a gateway that logs to PostgreSQL.
        from servemesh.predlog.postgres_store import PostgresStore

        return PostgresStore(dsn, settings.postgres_table)
    return ParquetStore(predictions_dir(state_dir), instance)


def gateway_prediction_log(spec: MeshSpec, instance: str, zone: str) -> PredictionLog:
    """The log of one gateway instance (not started: call `start` in the running loop)."""
    settings = spec.prediction_log
    context = RowContext(
        gateway=instance,
        gateway_zone=zone,
        max_output_bytes=settings.max_output_bytes,
        max_entity_ids=settings.max_entity_ids,
        max_message_chars=settings.max_message_chars,
        entity_of_model=entity_names(spec),
        max_feature_bytes=settings.max_feature_bytes,
        logged_features=logged_features(spec),
    )
    if not settings.enabled:
        return PredictionLog(settings, None, context)
    store = open_store(settings, spec.state_dir, instance)
    status = predictions_dir(spec.state_dir) / instance / STATUS_FILE
    return PredictionLog(settings, store, context, status)
