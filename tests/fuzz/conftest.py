"""One small mesh for the fuzz tests (one replica of each service per zone, the demo model),
stopped after the package's last test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from servemesh.launcher import Mesh
from servemesh.spec import DemoSpec, MeshSpec, ModelSpec, ModelVersionSpec, Ports


@pytest.fixture(scope="package")
def fuzz_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = MeshSpec(
        ports=Ports.free(),
        state_dir=str(tmp_path_factory.mktemp("fuzz-mesh")),
        models={
            "fraud": ModelSpec(
                versions={
                    "v1": ModelVersionSpec(source="demo:1"),
                    "v2": ModelVersionSpec(source="demo:2"),
                },
                traffic={"v1": 100, "v2": 0},
            )
        },
        demo=DemoSpec(enabled=True, entities=50),
    )
    with Mesh.from_spec(spec) as running:
        yield running
