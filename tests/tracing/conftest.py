"""One traced mesh for the package: tests/tracing/test_mesh_traces.py and
test_forced_sampling.py read the same spec (sample ratio 0, spans exported every 100 ms), so
they share one mesh, started by the first test that asks for it and stopped after the
package's last test.

The whole-trace tests run first: one of them checks that the store holds no trace but the
ones its module forced, which holds only before the budget tests force theirs (each of
those tests counts only its own trace ids and its own callers' buckets, so what ran before
them changes none of their numbers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.launcher import Mesh
from servemesh.tracestore.receiver import store_path
from servemesh.tracestore.store import TraceStore
from tests.mesh.conftest import test_mesh_spec

_HERE = Path(__file__).parent
# The modules on the traced mesh, in the order they run.
TRACED_MODULES = ("test_mesh_traces.py", "test_forced_sampling.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the traced mesh's modules in TRACED_MODULES order; every other item keeps its place."""
    slots = [i for i, item in enumerate(items) if item.path.parent == _HERE]
    ours = [items[i] for i in slots]

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return TRACED_MODULES.index(name) if name in TRACED_MODULES else -1

    for slot, item in zip(slots, sorted(ours, key=rank), strict=True):
        items[slot] = item


@pytest.fixture(scope="package")
def traced_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = test_mesh_spec(str(tmp_path_factory.mktemp("traced-mesh")), entities=50)
    # Ratio 0: only a caller's sampled traceparent records anything; spans leave quickly;
    # the default forced-trace budget.
    tracing = spec.tracing.model_copy(update={"sample_ratio": 0.0, "export_interval_ms": 100})
    with Mesh.from_spec(spec.model_copy(update={"tracing": tracing})) as mesh:
        yield mesh


@pytest.fixture(scope="package")
def store(traced_mesh: Mesh) -> Iterator[TraceStore]:
    opened = TraceStore(store_path(traced_mesh.state_dir))
    yield opened
    opened.close()
