"""Backups of every store a mesh keeps, and their restore (`servemesh backup|restore`).

One backup folder holds a part per store, each with its own manifest and checksums, and
a manifest over them:

    <out>/manifest.json     when, how long each part took, each part's summary, and the
                            sha256 of each part's own manifest
    <out>/registry/         a registry snapshot (registry/backup.py)
    <out>/features/         every key of the feature store (servemesh/features/backup.py)
    <out>/predictions/      the prediction log's Parquet files (predictions.py)
    <out>/routes/           the live routes, their history, the rollouts' records and
                            the drift references (routes.py)

A restore checks every part it is asked for before it writes anything: a backup that does
not verify changes nothing. Each part then puts back what the mesh lost and leaves what it
holds (keys and versions written since, rollouts recorded since): restore is for a store
that lost data, never a way to roll a mesh back.
"""
