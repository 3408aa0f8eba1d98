"""A model of two feature views keyed by different entities plus one raw input, answering two
outputs of different datatypes, served through the whole mesh (Envoy, Redis, model servers)
and checked against the same torch model run here."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from servemesh.contract.control_credential import control_metadata_for
from servemesh.identity import dial_edge, dial_service, mesh_identity
from servemesh.launcher import Mesh
from servemesh.registry.client import push_version
from servemesh.spec import MeshSpec, Ports, ResolvedSpec, parse_spec
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.model.torch_models import exported

LOTS = {"L-1": [13.2, 1.8, 2.4], "L-2": [12.1, 3.1, 2.2], "L-3": [14.0, 0.9, 2.7]}
MERCHANTS = {"m-1": [4.5, 120.0], "m-2": [2.0, 15.0]}

SIGNATURE: dict[str, list[dict[str, object]]] = {
    "inputs": [
        {"name": "chemistry", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "seller", "datatype": "FP64", "shape": [-1, 2]},
        {"name": "tasting", "datatype": "FP32", "shape": [-1, 3]},
    ],
    "outputs": [
        {"name": "probabilities", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "label", "datatype": "INT64", "shape": [-1]},
    ],
}


class Wine(torch.nn.Module):
    """Chemistry (FP32), seller (FP64, cast here) and tasting notes into three classes."""

    def __init__(self, seed: int = 2) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.chemistry = torch.nn.Parameter(torch.randn(3, 3, generator=generator) * 0.3)
        self.seller = torch.nn.Parameter(torch.randn(2, 3, generator=generator) * 0.02)
        self.tasting = torch.nn.Parameter(torch.randn(3, 3, generator=generator))
        self.bias = torch.nn.Parameter(torch.randn(3, generator=generator))

    def forward(
        self, chemistry: torch.Tensor, seller: torch.Tensor, tasting: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = (
            chemistry @ self.chemistry
            + seller.float() @ self.seller
            + tasting @ self.tasting
            + self.bias
        )
        probabilities = torch.softmax(logits, dim=-1)
        return probabilities, probabilities.argmax(dim=-1)


MODEL = Wine()


def reference(
    lots: list[str], merchants: list[str], tasting: list[list[float]]
) -> tuple[np.ndarray, np.ndarray]:
    """What the model answers for these rows, straight through torch."""
    with torch.inference_mode():
        probabilities, label = MODEL(
            torch.tensor([LOTS[lot] for lot in lots], dtype=torch.float32),
            torch.tensor([MERCHANTS[m] for m in merchants], dtype=torch.float64),
            torch.tensor(tasting, dtype=torch.float32),
        )
    return probabilities.numpy(), label.numpy()


SPEC_YAML = """
zones: [zone-a]
gateway: {per_zone: {zone-a: 1}}
feature: {per_zone: {zone-a: 1}}
model_servers: {per_zone: {zone-a: 1}}
feature_views:
  lot: {features: [alcohol, malic_acid, ash]}
  merchant: {entity: seller, features: [rating, volume]}
models:
  wine:
    inputs:
      chemistry: {view: lot, features: [alcohol, malic_acid, ash]}
      seller: {view: merchant, features: [rating, volume]}
      tasting: {raw: true}
    versions: {v1: {}}
    traffic: {v1: 100}
demo: {enabled: true, entities: 0}
"""


@pytest.fixture(scope="module")
def wine_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    state_dir = tmp_path_factory.mktemp("wine")
    declared = parse_spec(SPEC_YAML)
    spec = MeshSpec.model_validate(
        {
            **declared.model_dump(),
            "ports": Ports.free().model_dump(),
            "state_dir": str(state_dir),
        }
    )
    # Pushed before the model servers start, as the demo seeding does (a seed step).
    with Mesh.from_spec(spec, seed_steps=[push_wine]) as mesh:
        with dial_service(mesh.spec, "feature-zone-a-0").channel() as channel:
            features = feature_pb2_grpc.FeatureServiceStub(channel)
            for view, rows, names in (
                ("lot", LOTS, ["alcohol", "malic_acid", "ash"]),
                ("merchant", MERCHANTS, ["rating", "volume"]),
            ):
                features.WriteFeatures(
                    feature_pb2.WriteFeaturesRequest(
                        view=view,
                        entities=[
                            feature_pb2.EntityFeatures(
                                entity_id=key, values=dict(zip(names, values, strict=True))
                            )
                            for key, values in rows.items()
                        ],
                    ),
                    timeout=30,
                    metadata=control_metadata_for(mesh.state_dir),
                )
        yield mesh


async def push_wine(spec: ResolvedSpec, registry: grpc.aio.Channel) -> None:
    example = (torch.randn(2, 3), torch.randn(2, 2, dtype=torch.float64), torch.randn(2, 3))
    await push_version(
        registry,
        model="wine",
        version="v1",
        data=exported(MODEL, example),
        inputs=SIGNATURE["inputs"],
        outputs=SIGNATURE["outputs"],
        format="torch_export",
        credential=control_metadata_for(spec.state_dir),
    )


def test_named_outputs_match_the_model_run_locally(wine_mesh: Mesh) -> None:
    tasting = [[0.5, -1.0, 2.0], [1.5, 0.25, -0.75], [-2.0, 0.0, 1.0]]
    lots, merchants = ["L-1", "L-3", "L-1"], ["m-2", "m-1", "m-1"]
    request = gateway_pb2.PredictRequest(
        model="wine",
        entities=[
            gateway_pb2.EntityRow(ids={"lot": lot, "seller": m})
            for lot, m in zip(lots, merchants, strict=True)
        ],
    )
    request.inputs["tasting"].CopyFrom(
        gateway_pb2.Tensor(
            datatype="FP32", shape=[3, 3], float_values=[v for row in tasting for v in row]
        )
    )
    with dial_edge(wine_mesh.spec).channel() as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Predict(request, timeout=30)
    probabilities, label = reference(lots, merchants, tasting)
    assert len(set(label.tolist())) == 3  # rows that tell the classes apart
    assert sorted(reply.outputs) == ["label", "probabilities"]
    got = reply.outputs["probabilities"]
    assert got.datatype == "FP32" and list(got.shape) == [3, 3]
    np.testing.assert_allclose(
        np.array(got.float_values).reshape(3, 3), probabilities, rtol=1e-5, atol=1e-6
    )
    assert reply.outputs["label"].datatype == "INT64"
    assert list(reply.outputs["label"].int64_values) == label.tolist()
    assert list(reply.scores) == []  # two outputs: no single score
    assert reply.model_version == "v1" and not reply.degraded


def test_the_cli_names_entities_and_inputs_and_prints_named_outputs(wine_mesh: Mesh) -> None:
    done = subprocess.run(
        [
            sys.executable, "-m", "servemesh", "predict", "--model", "wine",
            "--entity", "lot=L-2,seller=m-1", "--entity", "seller=m-2,lot=L-1",
            "--input", "tasting=1,2,3", "--input", "tasting=0.5,0.5,-4",
            "--address", wine_mesh.spec.edge_address, "--state-dir", str(wine_mesh.state_dir),
            "--json",
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    probabilities, label = reference(["L-2", "L-1"], ["m-1", "m-2"], [[1, 2, 3], [0.5, 0.5, -4]])
    assert answer["outputs"]["label"] == {
        "datatype": "INT64",
        "shape": [2],
        "values": label.tolist(),
    }
    np.testing.assert_allclose(
        answer["outputs"]["probabilities"]["values"], probabilities, rtol=1e-5, atol=1e-6
    )
    assert answer["scores"] == [] and answer["model_version"] == "v1" and answer["request_id"]
    assert answer["degraded"] is False and answer["degraded_reason"] == ""


def test_a_raw_input_that_does_not_fit_the_model_is_refused_naming_it(wine_mesh: Mesh) -> None:
    request = gateway_pb2.PredictRequest(
        model="wine", entities=[gateway_pb2.EntityRow(ids={"lot": "L-1", "seller": "m-1"})]
    )
    request.inputs["tasting"].CopyFrom(gateway_pb2.Tensor(shape=[1, 2], float_values=[1, 2]))
    with dial_edge(wine_mesh.spec).channel() as channel:
        with pytest.raises(grpc.RpcError) as err:
            gateway_pb2_grpc.GatewayStub(channel).Predict(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(
        "inputs['tasting'].shape: model 'wine' takes [-1, 3] (3 values per row), got [1, 2]"
    )


def test_the_cli_prints_each_output_per_row(wine_mesh: Mesh) -> None:
    done = subprocess.run(
        [
            sys.executable, "-m", "servemesh", "predict", "--model", "wine",
            "--entity", "lot=L-2,seller=m-1", "--input", "tasting=1,2,3",
            "--address", wine_mesh.spec.edge_address, "--state-dir", str(wine_mesh.state_dir),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    probabilities, label = reference(["L-2"], ["m-1"], [[1, 2, 3]])
    shown = ", ".join(f"{p:.6f}" for p in probabilities[0])
    assert f"lot=L-2,seller=m-1: label {label[0]}  probabilities [{shown}]" in done.stdout


def test_grpcurl_writes_entities_and_inputs_and_reads_named_outputs_as_json(
    wine_mesh: Mesh,
) -> None:
    body = {
        "model": "wine",
        "entities": [{"ids": {"lot": "L-3", "seller": "m-2"}}],
        "inputs": {"tasting": {"datatype": "FP32", "shape": [1, 3], "float_values": [1, 0, -1]}},
    }
    done = subprocess.run(
        [str(Path(sys.executable).parent / "grpcurl"), "-d", json.dumps(body),
         "-cacert", str(mesh_identity(wine_mesh.spec).trust_file),
         wine_mesh.spec.edge_address, "servemesh.gateway.v1.Gateway/Predict"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    probabilities, label = reference(["L-3"], ["m-2"], [[1, 0, -1]])
    assert answer["outputs"]["label"] == {
        "datatype": "INT64",
        "shape": ["1"],
        "int64_values": [str(label[0])],
    }
    np.testing.assert_allclose(
        answer["outputs"]["probabilities"]["float_values"], probabilities[0], rtol=1e-5
    )
