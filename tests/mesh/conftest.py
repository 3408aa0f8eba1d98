"""A whole local mesh (Redis, registry, model servers, features, gateways, Envoy) for the
package (`mesh`), package-scoped: the modules on it run as one group (tests/conftest.py,
`worker_group`), so it starts once, with the group's first test, and stops after its last.
The package's modules that never ask for it start a mesh or an Envoy of their own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.identity.edge_client import dial_edge_as
from servemesh.launcher import Mesh
from servemesh.proxy.admin import AdminClient
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_apply import LiveApply
from servemesh.spec import DemoSpec, MeshSpec, ModelSpec, ModelVersionSpec, Ports
from servemesh_api.gateway.v1 import gateway_pb2_grpc
from tests.waiting import wait_until

# v3 is the demo model made slow on purpose (300 ms per batch): the deadline tests pin it.
# Long enough that a deadline just below it surely reaches a replica on a busy machine (with
# too little time left for a batch there), short enough that two batches in a row stay
# below the mesh's 1 s per-try timeout.
SLOW_VERSION = "v3"
SLOW_MS = 300.0


_HERE = Path(__file__).parent


def on_package_mesh(item: pytest.Item) -> bool:
    """Whether a test of this package asks for the package's `mesh` (itself or through
    another fixture), rather than for a fixture of its own module that has the same name."""
    return (
        isinstance(item, pytest.Function)
        and item.path.parent == _HERE
        and "mesh" in item.fixturenames
        and "mesh" not in vars(item.module)
    )


def test_mesh_spec(state_dir: str, entities: int = 500) -> MeshSpec:
    return MeshSpec(
        ports=Ports.free(),
        state_dir=state_dir,
        models={
            "fraud": ModelSpec(
                versions={
                    "v1": ModelVersionSpec(source="demo:1"),
                    "v2": ModelVersionSpec(source="demo:2"),
                    SLOW_VERSION: ModelVersionSpec(source="demo:1", inject_latency_ms=SLOW_MS),
                },
                traffic={"v1": 100, "v2": 0, SLOW_VERSION: 0},
            )
        },
        demo=DemoSpec(enabled=True, entities=entities),
    )


# A helper, not a test (pytest reads the attribute; mypy knows no attributes on functions).
test_mesh_spec.__test__ = False  # type: ignore[attr-defined]


@pytest.fixture(scope="package")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    state_dir = tmp_path_factory.mktemp("mesh")
    with Mesh.from_spec(test_mesh_spec(str(state_dir))) as running:
        yield running


@pytest.fixture
def gateway(mesh: Mesh) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    """A Predict stub talking to Envoy's edge listener as the operator (its certificate):
    these tests pin versions the traffic split gives 0%, which only operators may."""
    with dial_edge_as(mesh.spec, mesh.spec.edge_address).channel() as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def log_lines(mesh: Mesh, instance: str) -> list[dict[str, object]]:
    """The JSON lines of `instance`'s log so far."""
    lines = (mesh.logs_dir / f"{instance}.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def apply_live(mesh: Mesh, text: str, instance: str) -> list[str]:
    """`servemesh apply` of `text` to the running mesh, then wait until `instance` took the
    new spec (it logs each change it takes); the plan's lines."""

    def taken() -> int:
        return sum(1 for line in log_lines(mesh, instance) if line.get("msg") == "spec changed")

    before = taken()
    applier = LiveApply(RouteManager(mesh.paths, AdminClient.of_mesh(mesh.state_dir)))
    lines = applier.apply(text, "live.yaml").plan.lines()
    wait_until(lambda: taken() > before, f"{instance} to take the new spec")
    return lines
