"""One mesh for the metrics tests, with its Prometheus (Debian's `prometheus` package),
stopped after the package's last test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh_api.gateway.v1 import gateway_pb2_grpc
from tests.mesh.conftest import test_mesh_spec


@pytest.fixture(scope="package")
def metrics_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    state_dir = tmp_path_factory.mktemp("metrics-mesh")
    with Mesh.from_spec(test_mesh_spec(str(state_dir), entities=50)) as running:
        yield running


@pytest.fixture
def edge(metrics_mesh: Mesh) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    with dial_edge(metrics_mesh.spec).channel() as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)
