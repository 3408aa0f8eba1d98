"""Seeing a running mesh: scraping its /metrics, asking its Prometheus, `servemesh top`,
and the cost of a million predictions.

- `scrape.py`: one endpoint's Prometheus text as samples; sums, deltas, quantiles.
- `prom_query.py`: the mesh's Prometheus HTTP API (queries, targets).
- `cpu.py`: CPU seconds of every mesh process (its own counter, or /proc for Envoy, Redis).
- `top.py`: req/s, error ratio, p50/p99 per service, model version and zone, and the cost.
"""
