"""Batch prediction: score every entity of a feature view (or a file of ids) with a
registry artifact, in full batches, into Parquet, PostgreSQL or Redis (docs/batch.md).

| module | what |
| --- | --- |
| `errors` | BatchError and its kinds (exit 1, naming the field) |
| `source` | the ids to score, and the rows of a view version pinned for the whole run |
| `where` | `--where`: a filter on a row's event time and features |
| `scorer` | the registry's verified artifact, loaded the way a model server loads it |
| `writers` | Parquet, PostgreSQL and Redis outputs, each complete or not there |
| `checkpoint` | what an interrupted run leaves, and what `--resume` continues from |
| `job` | one run: read, score, write, checkpoint, chunk by chunk |
| `runs` | a run against a running mesh (its registry and Redis), recorded in the history |
| `schedule` | the spec's `batch:` jobs and when each is due |
| `scheduler` | a round of the due jobs, and the process `servemesh up` starts to run them |
| `history` | one record per run, under the state dir |
"""
