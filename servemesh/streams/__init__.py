"""Streaming predictions: a consumer group on a Redis stream, one prediction per event.

    keys       where a stream's state lives in Redis, and what an entry id means
    events     an input entry's fields, checked (or the Poison they are)
    predict    events to predictions: through the mesh's edge, or in this process
    consumer   the loop: claim, read, score, write (idempotently), then acknowledge
    metrics    lag and throughput (Prometheus, and what `servemesh stream status` reads)
    process    `servemesh stream consume` and the process `servemesh up` starts per stream

docs/serving-patterns.md says when to use it; docs/runbooks/stream-consumer-crash.md what
to do when a consumer dies.
"""
