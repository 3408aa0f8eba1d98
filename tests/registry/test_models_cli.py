"""`servemesh models ...` run as a user runs it (`python -m servemesh`), against a real
registry and a real model server on loopback, found through a running mesh's state dir.

The models are real torch modules exported with torch.export or scripted with TorchScript
(tests/model/torch_models.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml

from servemesh.identity import dial_address, serving_credentials
from servemesh.registry.app import registry_server
from servemesh.registry.store import RegistryStore
from servemesh.services.model.loader import registry_loader
from servemesh.services.model.service import InferenceServicer
from servemesh.spec import MeshSpec, Replicas, ResolvedSpec, dump_spec, resolve
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.registry.v1 import registry_pb2_grpc
from tests.control_kit import TEST_TOKEN, credentialed_channel, install_test_token
from tests.model.model_helpers import REPLICA, Stub, serving_at
from tests.model.torch_models import (
    CHURN_FEATURES,
    CHURN_SIGNATURE_YAML,
    Churn,
    churn_example,
    churn_reference,
    exported,
    scripted,
)
from tests.registry.registry_kit import MAX_ARTIFACT_BYTES, RunningRegistry, blob_files, temp_files

pytestmark = pytest.mark.timeout(300)

DATA_SHA = "sha256:" + "3f" * 32
CODE_SHA = "9ce8f64"


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


def planned_spec(root: Path, max_artifact_bytes: int = MAX_ARTIFACT_BYTES) -> ResolvedSpec:
    """The mesh of the state dir `root`: one replica of each service in one zone."""
    one = Replicas(per_zone={"zone-a": 1})
    declared = MeshSpec(
        zones=["zone-a"], gateway=one, feature=one, model_servers=one, state_dir=str(root)
    )
    declared = declared.model_copy(
        update={
            "limits": declared.limits.model_copy(update={"max_artifact_bytes": max_artifact_bytes})
        }
    )
    return resolve(declared)


def mesh_state(resolved: ResolvedSpec, registry: str, model_server: str) -> Path:
    """A state dir as `servemesh up` leaves it, naming these registry and model server."""
    root = Path(resolved.state_dir)
    ports = {
        **resolved.instance_ports,
        "registry-0": int(registry.rsplit(":", 1)[1]),
        REPLICA: int(model_server.rsplit(":", 1)[1]),
    }
    spec = ResolvedSpec.model_validate({**resolved.model_dump(), "instance_ports": ports})
    root.mkdir(parents=True, exist_ok=True)
    (root / "mesh.resolved.yaml").write_text(dump_spec(spec))
    install_test_token(root)  # what the test registry checks
    return root


async def servemesh(*args: str, state_dir: Path, tmp: Path) -> Done:
    """`python -m servemesh models --state-dir ... ARGS` in a subprocess (the loop runs on)."""
    tmp.mkdir(exist_ok=True)
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "servemesh",
        "models",
        "--state-dir",
        str(state_dir),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmp), "COLUMNS": "200"},
    )
    stdout, stderr = await process.communicate()
    assert process.returncode is not None
    return Done(process.returncode, stdout.decode(), stderr.decode())


@dataclass
class Mesh:
    registry: RunningRegistry
    stub: Stub
    state_dir: Path
    tmp: Path

    async def run(self, *args: str) -> Done:
        return await servemesh(*args, state_dir=self.state_dir, tmp=self.tmp)


@pytest.fixture
async def mesh(store: RegistryStore, tmp_path: Path) -> AsyncIterator[Mesh]:
    """A registry and a model server that loads from it, and a state dir naming both; both
    serve mutual TLS with the state dir's certificates, as a running mesh's do."""
    spec = planned_spec(tmp_path / "state")
    registry = registry_server(
        store,
        spec.registry_instance,
        port=0,
        control_token=TEST_TOKEN,
        credentials=serving_credentials(spec, spec.registry_instance),
    )
    address = f"127.0.0.1:{await registry.start()}"
    channel = credentialed_channel(
        dial_address(spec, address, spec.registry_instance, caller=REPLICA)
    )
    running = RunningRegistry(store, registry, channel, registry_pb2_grpc.RegistryStub(channel),
                              address)  # fmt: skip
    loader = registry_loader(channel, MeshSpec(models={}), retry_for_s=0)
    servicer = InferenceServicer(replica=REPLICA, zone="zone-a", loader=loader)
    try:
        async with serving_at(servicer, spec) as (stub, port):
            state = mesh_state(spec, address, f"127.0.0.1:{port}")
            yield Mesh(running, stub, state, tmp_path / "cli-tmp")
    finally:
        await channel.close()
        await registry.drain()


def churn_request(features: np.ndarray, category: np.ndarray) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name="churn")
    request.inputs.add(name="features", datatype="FP32", shape=list(features.shape))
    request.inputs.add(name="category", datatype=category.dtype.name.upper(), shape=[len(category)])
    request.raw_input_contents.extend([features.tobytes(), category.tobytes()])
    return request


async def test_an_exported_model_pushed_with_the_cli_is_loaded_and_answers_both_outputs(
    mesh: Mesh, tmp_path: Path
) -> None:
    churn = Churn(seed=11)
    artifact = tmp_path / "churn.pt2"
    artifact.write_bytes(exported(churn, churn_example()))
    signature = tmp_path / "sig.yaml"
    signature.write_text(yaml.safe_dump(CHURN_SIGNATURE_YAML))

    pushed = await mesh.run(
        "push", str(artifact), "--model", "churn", "--version", "v1",
        "--signature", str(signature), "--label", "team=growth",
        "--lineage", f"data={DATA_SHA}", "--lineage", f"code={CODE_SHA}", "--metric", "auc=0.91",
    )  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    assert "pushed churn v1: torch_export" in pushed.stdout
    assert "probe: 2 rows (zeros, ones) answered probabilities [2, 3], label [2]" in pushed.stdout
    record = mesh.registry.store.get_version("churn", "v1")
    assert (record.format, dict(record.labels)) == ("torch_export", {"team": "growth"})
    assert dict(record.lineage) == {"data": DATA_SHA, "code": CODE_SHA}
    assert dict(record.metrics) == {"auc": 0.91}

    load = oip.RepositoryModelLoadRequest(model_name="churn")
    load.parameters["version"].string_param = "v1"
    await mesh.stub.RepositoryModelLoad(load, timeout=60)
    rng = np.random.default_rng(3)
    features = rng.normal(size=(4, CHURN_FEATURES)).astype(np.float32)
    category = np.array([0, 1, 4, 2], np.int64)
    response = await mesh.stub.ModelInfer(churn_request(features, category), timeout=10)
    assert (response.model_version, [o.name for o in response.outputs]) == (
        "v1",
        ["probabilities", "label"],
    )
    probabilities, label = churn_reference(churn, features, category)
    got = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(4, 3)
    np.testing.assert_allclose(got, probabilities, rtol=1e-5)
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[1], "<i8"), label)

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await mesh.stub.ModelInfer(churn_request(features, category.astype(np.int32)), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'category'" in (caught.value.details() or "")

    listed = await mesh.run("list", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert (row["model"], row["version"], row["format"], row["replicas"]) == (
        "churn",
        "v1",
        "torch_export",
        [REPLICA],
    )
    assert row["size_bytes"] == artifact.stat().st_size and row["weight"] is None

    aliased = await mesh.run("alias", "churn", "production", "v1")
    assert aliased.returncode == 0, aliased.stderr
    assert aliased.stdout.strip() == "churn: production -> v1"

    shown = await mesh.run("show", "churn", "production", "--json")
    assert shown.returncode == 0, shown.stderr
    version = json.loads(shown.stdout)
    assert version["aliases"] == ["production"] and version["sha256"] == record.sha256
    assert version["lineage"] == {"data": DATA_SHA, "code": CODE_SHA}
    assert version["metrics"] == {"auc": 0.91} and version["replicas"] == [REPLICA]
    assert version["inputs"] == CHURN_SIGNATURE_YAML["inputs"]
    assert version["outputs"] == CHURN_SIGNATURE_YAML["outputs"]


async def test_list_and_show_print_tables_of_what_was_pushed(mesh: Mesh, tmp_path: Path) -> None:
    scripted_file = tmp_path / "churn.pt"
    scripted_file.write_bytes(scripted(Churn(seed=2)))
    signature = tmp_path / "sig.yaml"
    signature.write_text(yaml.safe_dump(CHURN_SIGNATURE_YAML))
    exported_file = tmp_path / "churn.pt2"
    exported_file.write_bytes(exported(Churn(seed=3), churn_example()))
    first = await mesh.run(
        "push", str(scripted_file), "--model", "churn", "--version", "v1", "--signature",
        str(signature),
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    assert "pushed churn v1: torchscript" in first.stdout
    second = await mesh.run(
        "push", str(exported_file), "--model", "churn", "--version", "v2", "--metric", "auc=0.93"
    )  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert "probe: 2 rows (zeros, ones) answered output_0 [2, 3], output_1 [2]" in second.stdout

    listed = await mesh.run("list")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    v1 = next(line for line in lines if " v1 " in line)
    v2 = next(line for line in lines if " v2 " in line)
    assert "churn" in v1 and "torchscript" in v1 and "KiB" in v1
    assert "torch_export" in v2
    assert "live weights unavailable" in listed.stdout  # no Envoy in this test

    shown = await mesh.run("show", "churn", "v2")
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    record = mesh.registry.store.get_version("churn", "v2")
    for expected in ("churn v2", record.sha256, "torch_export", "auc=0.93", "output_1", "INT64"):
        assert expected in text


BAD = [
    ("not-a-model", "not a model: neither a TorchScript (.pt) nor a torch.export (.pt2) archive"),
    ("truncated", "truncated or damaged archive"),
    ("probe-mismatch", "the probe batch: model output 'label' is INT64, the signature says FP32"),
    ("over-the-limit", "bytes is over the mesh's artifact limit of 1024 bytes"),
    ("no-signature", "a TorchScript archive records no signature: declare one"),
    ("hostile", "torch.export archive refused: data/weights/model_weights_config.json"),
]


@pytest.mark.parametrize(("case", "message"), BAD, ids=[case for case, _ in BAD])
async def test_a_bad_artifact_is_refused_with_one_line_and_nothing_uploaded(
    mesh: Mesh, tmp_path: Path, case: str, message: str
) -> None:
    from tests.model import crafted_pt2

    good = exported(Churn(), churn_example())
    args = ["--model", "churn", "--version", "v1"]
    state_dir = mesh.state_dir
    artifact = tmp_path / "model.pt2"
    if case == "not-a-model":
        artifact.write_text("user,score\nuser-1,0.5\n")
    elif case == "truncated":
        artifact.write_bytes(good[: len(good) - 200])
    elif case == "probe-mismatch":
        wrong = {**CHURN_SIGNATURE_YAML, "outputs": [*CHURN_SIGNATURE_YAML["outputs"][:1]]}
        wrong["outputs"].append({"name": "label", "datatype": "FP32", "shape": [-1]})
        (tmp_path / "sig.yaml").write_text(yaml.safe_dump(wrong))
        artifact = tmp_path / "model.pt"
        artifact.write_bytes(scripted(Churn()))
        args += ["--signature", str(tmp_path / "sig.yaml")]
    elif case == "over-the-limit":
        artifact.write_bytes(good)
        spec = yaml.safe_load((state_dir / "mesh.resolved.yaml").read_text())
        spec["limits"]["max_artifact_bytes"] = 1024
        state_dir = tmp_path / "small-state"
        state_dir.mkdir()
        (state_dir / "mesh.resolved.yaml").write_text(yaml.safe_dump(spec))
    elif case == "no-signature":
        artifact = tmp_path / "model.pt"
        artifact.write_bytes(scripted(Churn()))
    elif case == "hostile":
        artifact.write_bytes(crafted_pt2.with_pickled_weight(good, tmp_path / "ran"))

    done = await servemesh("push", str(artifact), *args, state_dir=state_dir, tmp=mesh.tmp)

    assert done.returncode == 1
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("models push: ") and message in line, line
    root = mesh.registry.store.root
    assert mesh.registry.store.list_models() == []
    assert blob_files(root) == [] and temp_files(root) == []
    assert list(mesh.tmp.iterdir()) == []  # the CLI left no temp file behind
    assert not (tmp_path / "ran").exists()


async def test_malformed_lineage_is_refused_naming_the_flag_and_key(
    mesh: Mesh, tmp_path: Path
) -> None:
    artifact = tmp_path / "churn.pt2"
    artifact.write_bytes(exported(Churn(), churn_example()))
    done = await mesh.run(
        "push", str(artifact), "--model", "churn", "--version", "v1",
        "--lineage", "data=md5:abc", "--metric", "auc=0.9",
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "models push: --lineage[data]: 'md5:abc' is not sha256:<64 lowercase hex>"
    )
    assert mesh.registry.store.list_models() == []


def served_rows(response: oip.ModelInferResponse, rows: int) -> np.ndarray:
    return np.frombuffer(response.raw_output_contents[0], "<f4").reshape(rows, 1)


def demo_request(rows: np.ndarray, version: str) -> oip.ModelInferRequest:
    request = oip.ModelInferRequest(model_name="fraud", model_version=version)
    request.inputs.add(name="features", datatype="FP32", shape=list(rows.shape))
    request.raw_input_contents.append(rows.tobytes())
    return request


async def push_v1(mesh: Mesh, artifact: Path, data: bytes, signature: Mapping[str, Any]) -> None:
    """`models push` of `data` (saved as `artifact`) as v1 of the model named by its stem."""
    artifact.write_bytes(data)
    signature_file = artifact.with_suffix(".sig.yaml")
    signature_file.write_text(yaml.safe_dump(dict(signature)))
    pushed = await mesh.run(
        "push", str(artifact), "--model", artifact.stem, "--version", "v1",
        "--signature", str(signature_file),
    )  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr


async def test_quantize_pushes_a_checked_int8_version_that_a_model_server_serves(
    mesh: Mesh, tmp_path: Path
) -> None:
    from servemesh.contract.demo import demo_artifact, demo_signature

    await push_v1(mesh, tmp_path / "fraud.pt", demo_artifact(1).data, demo_signature())

    done = await mesh.run("quantize", "fraud", "v1", "--to", "int8")
    assert done.returncode == 0, done.stderr
    assert "pushed fraud v1-int8: dynamic-int8 of v1 (3 layers), torchscript" in done.stdout
    store = mesh.registry.store
    source, derived = store.get_version("fraud", "v1"), store.get_version("fraud", "v1-int8")
    assert dict(derived.lineage) == {
        "source_version": "v1",
        "source_sha256": source.sha256,
        "method": "dynamic-int8",
    }
    assert dict(derived.labels) == {"derived": "dynamic-int8"}
    metrics = dict(derived.metrics)
    assert metrics["quantize_reference_rows"] == 66
    assert 0 < metrics["quantize_max_abs_error"] <= 0.05
    assert metrics["quantize_label_agreement"] >= 0.99
    assert derived.size_bytes < source.size_bytes / 3  # INT8 weights, a quarter of FP32's
    assert [(t.name, t.datatype) for t in derived.inputs] == [("features", "FP32")]

    # A model server loads it like any version and answers close to its source.
    for version in ("v1", "v1-int8"):
        load = oip.RepositoryModelLoadRequest(model_name="fraud")
        load.parameters["version"].string_param = version
        await mesh.stub.RepositoryModelLoad(load, timeout=60)
    rows = np.random.default_rng(5).normal(size=(16, 64)).astype(np.float32)
    fp32 = await mesh.stub.ModelInfer(demo_request(rows, "v1"), timeout=10)
    int8 = await mesh.stub.ModelInfer(demo_request(rows, "v1-int8"), timeout=10)
    assert int8.model_version == "v1-int8"
    np.testing.assert_allclose(served_rows(int8, 16), served_rows(fp32, 16), atol=0.05)


async def test_quantize_refuses_with_the_numbers_and_pushes_nothing(
    mesh: Mesh, tmp_path: Path
) -> None:
    churn = exported(Churn(seed=4), churn_example())
    await push_v1(mesh, tmp_path / "churn.pt2", churn, CHURN_SIGNATURE_YAML)

    # Churn multiplies by a weight matrix with no linear layer: nothing for INT8 to cover.
    done = await mesh.run("quantize", "churn", "v1", "--to", "int8")
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("models quantize: ") and "no linear layer" in line, line

    # Rows drawn from the signature put categories 5..7 past Churn's table of 5: the source
    # itself fails on them, and the error says to give rows it takes.
    done = await mesh.run("quantize", "churn", "v1", "--to", "fp16")
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "the source model fails on the reference rows" in done.stderr, done.stderr
    assert "--reference" in done.stderr

    rng = np.random.default_rng(2)
    reference = tmp_path / "rows.npz"
    np.savez(
        reference,
        features=rng.normal(size=(40, CHURN_FEATURES)).astype(np.float32),
        category=rng.integers(0, 5, size=40),
    )
    # FP16 keeps the signature (FP32 probabilities, INT64 labels); a zero error limit refuses.
    done = await mesh.run(
        "quantize", "churn", "v1", "--to", "fp16", "--reference", str(reference),
        "--max-abs-error", "0",
    )  # fmt: skip
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    [line] = done.stderr.splitlines()
    assert "max |error|" in line and "(limit 0)" in line and "nothing was pushed" in line, line
    assert "of 40 reference rows" in line, line
    assert [v.version for v in mesh.registry.store.list_versions("churn")] == ["v1"]

    # A reference file that does not fit the signature is refused naming the input.
    np.savez(tmp_path / "short.npz", features=np.zeros((4, 3), np.float32), category=np.zeros(4))
    done = await mesh.run(
        "quantize", "churn", "v1", "--to", "fp16", "--reference", str(tmp_path / "short.npz")
    )
    assert done.returncode == 1 and "input 'features' has shape [4, 3]" in done.stderr, done.stderr

    done = await mesh.run(
        "quantize", "churn", "v1", "--to", "fp16", "--as", "half", "--reference", str(reference)
    )
    assert done.returncode == 0, done.stderr
    assert "checked on 40 reference rows" in done.stdout, done.stdout
    half = mesh.registry.store.get_version("churn", "half")
    assert [(t.name, t.datatype) for t in half.outputs] == [
        ("probabilities", "FP32"),
        ("label", "INT64"),
    ]
    assert dict(half.metrics)["quantize_label_agreement"] >= 0.99
