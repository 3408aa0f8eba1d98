"""`servemesh bench model`: the model server, closed and open loop, against its references.

targets (the processes under load), load (the load generators), run (the orchestration and
the report). See docs/benchmarks.md for results and how to read them.
"""

from servemesh.bench.model.run import main

__all__ = ["main"]
