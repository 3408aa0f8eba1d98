"""Benchmarks: each starts what it measures (a mesh of its own, a model server, a peer such
as Triton or the echo server) and measures both sides of every ratio in the same run.
`servemesh bench <name>` runs one (servemesh/cli/bench.py)."""
