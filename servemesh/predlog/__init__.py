"""The prediction log: one record per Predict a gateway answers, queryable afterwards.

    record.py          what a call captures (request path) and the row it becomes (writer)
    buffer.py          PredictionLog: the bounded buffer, the flusher, its counters
    parquet_store.py   the embedded store: Parquet files per gateway instance
    postgres_store.py  PostgreSQL, when the spec names a DSN
    wiring.py          the store and log a gateway's spec asks for
    query.py           LogQuery answered by DuckDB (Parquet) or PostgreSQL

`servemesh log` (servemesh/cli/log.py) is the command line over query.py.
"""

from servemesh.predlog.buffer import PredictionLog
from servemesh.predlog.record import PredictWatch
from servemesh.predlog.wiring import gateway_prediction_log

__all__ = ["PredictWatch", "PredictionLog", "gateway_prediction_log"]
