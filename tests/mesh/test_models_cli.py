"""`servemesh models` against a whole running mesh: live weights from Envoy, replicas that
hold each version, and a pushed torch.export model loaded onto one replica."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from servemesh.contract.control_credential import control_metadata_for
from servemesh.contract.wire import LOAD_CONFIG_PARAMETER, LOAD_VERSION_PARAMETER
from servemesh.identity import dial_service
from servemesh.launcher import Mesh
from servemesh.spec import ModelInputSpec, ModelSpec, ModelVersionSpec
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from tests.mesh.conftest import SLOW_VERSION
from tests.model.torch_models import CHURN_SIGNATURE_YAML, Churn, churn_example, exported

# churn's spec entry: both inputs sent by the caller, v1 from the registry.
CHURN_ENTRY = ModelSpec(
    inputs={"features": ModelInputSpec(raw=True), "category": ModelInputSpec(raw=True)},
    versions={"v1": ModelVersionSpec()},
    traffic={"v1": 100},
)


def models(mesh: Mesh, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "servemesh", "models", "--state-dir", str(mesh.state_dir), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def listed(mesh: Mesh) -> dict[tuple[str, str], dict[str, Any]]:
    done = models(mesh, "list", "--json")
    assert done.returncode == 0, done.stderr
    return {(row["model"], row["version"]): row for row in json.loads(done.stdout)}


def test_list_shows_live_weights_and_the_replicas_that_hold_each_version(
    mesh: Mesh, tmp_path: Path
) -> None:
    replicas = sorted(i.name for i in mesh.spec.instances() if i.service == "model")
    before = listed(mesh)
    assert {key: row["weight"] for key, row in before.items()} == {
        ("fraud", "v1"): 100,
        ("fraud", "v2"): 0,
        ("fraud", SLOW_VERSION): 0,
    }
    assert all(sorted(row["replicas"]) == replicas for row in before.values())

    artifact = tmp_path / "churn.pt2"
    artifact.write_bytes(exported(Churn(), churn_example()))
    signature = tmp_path / "sig.yaml"
    signature.write_text(yaml.safe_dump(CHURN_SIGNATURE_YAML))
    pushed = models(
        mesh, "push", str(artifact), "--model", "churn", "--version", "v1",
        "--signature", str(signature),
    )  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    # Pushed, not served: listed with no replica and no weight.
    after = listed(mesh)
    churn = after[("churn", "v1")]
    assert churn["replicas"] == [] and churn["format"] == "torch_export"
    assert churn["weight"] is None  # the spec routes no traffic to it
    table = models(mesh, "list")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert "100%" in next(line for line in lines if "fraud" in line and " v1 " in line)
    # Nor can an operator put it on fraud's servers by hand: a model server reads only its
    # own pool's models from the registry (a model of no pool of its: refused, not loaded).
    credential = control_metadata_for(mesh.state_dir)
    with dial_service(mesh.spec, replicas[0]).channel() as channel:
        request = oip.RepositoryModelLoadRequest(model_name="churn")
        request.parameters[LOAD_VERSION_PARAMETER].string_param = "v1"
        request.parameters[LOAD_CONFIG_PARAMETER].string_param = CHURN_ENTRY.model_dump_json()
        with pytest.raises(grpc.RpcError) as refused:
            grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(
                request, timeout=120, metadata=credential
            )
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "reads only its own pool's models" in str(refused.value.details())
    assert ("churn", "v1") not in {key for key, row in listed(mesh).items() if row["replicas"]}
