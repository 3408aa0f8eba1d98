"""A prediction made from features older than their view allows says so: `degraded`, with
the stale entities named, under the view's `degraded` staleness policy."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from servemesh.contract.demo import DEMO_FEATURES
from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.spec import MeshSpec
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc

ONE_ZONE = {"per_zone": {"zone-a": 1}}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """One zone whose `user` view serves rows up to an hour old, and older ones degraded."""
    spec = MeshSpec.model_validate(
        {
            "zones": ["zone-a"],
            "ports": {"edge": 0, "mesh": 0, "envoy_admin": 0, "services_base": 0},
            "gateway": ONE_ZONE,
            "feature": ONE_ZONE,
            "model_servers": ONE_ZONE,
            "demo": {"entities": 10},
            "feature_views": {
                "user": {"features": DEMO_FEATURES, "max_age": "1h", "staleness": "degraded"}
            },
        }
    )
    with Mesh.from_spec(spec, tmp_path_factory.mktemp("stale") / "state") as running:
        yield running


def test_old_features_degrade_the_answer_and_name_the_entity(mesh: Mesh, tmp_path: Path) -> None:
    now = int(time.time())
    rows = np.random.default_rng(3).normal(size=(2, len(DEMO_FEATURES)))
    csv = tmp_path / "users.csv"
    lines = [",".join(["id", "event_ts", *DEMO_FEATURES])]
    for entity, seen, row in zip(["old-1", "new-1"], [now - 7200, now], rows, strict=True):
        lines.append(",".join([entity, str(seen), *map(str, row)]))
    csv.write_text("\n".join(lines) + "\n")
    load = subprocess.run(
        [sys.executable, "-m", "servemesh", "features", "load", str(csv), "--view", "user",
         "--key", "id", "--timestamp", "event_ts", "--state-dir", str(mesh.state_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert load.returncode == 0, load.stderr

    with dial_edge(mesh.spec).channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        def predict(*entities: str) -> gateway_pb2.PredictResponse:
            request = gateway_pb2.PredictRequest(model="fraud", entity_ids=list(entities))
            return stub.Predict(request, timeout=10)

        fresh = predict("new-1")
        assert not fresh.degraded and fresh.degraded_reason == ""
        stale = predict("new-1", "old-1")
        assert stale.degraded
        assert stale.degraded_reason == "stale features for old-1"
        # The stored values still answered: a real score for each entity, from the model.
        assert len(stale.scores) == 2 and stale.model_version == "v1"
        assert stale.scores[0] == pytest.approx(fresh.scores[0], rel=1e-5)
