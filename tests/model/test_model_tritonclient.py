"""OIP v2 compatibility, proven with NVIDIA's own client: tritonclient[grpc], unchanged.

tritonclient pins an older grpcio/protobuf than servemesh, so it lives in .venv-triton
(`make test` creates it; `make triton-venv` alone). The client runs as a subprocess with that
interpreter against a real model server on loopback, and prints JSON that is checked here.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from servemesh.contract.demo import Artifact
from servemesh.services.model.app import SERVICE_NAME
from servemesh.services.model.service import InferenceServicer
from servemesh.services.runtime import ServiceServer
from servemesh_api.inference import grpc_service_pb2_grpc
from tests.model.model_helpers import REPLICA
from tests.model.test_model_server import demo_loader

REPO = Path(__file__).resolve().parents[2]
TRITON_PYTHON = REPO / ".venv-triton" / "bin" / "python"
SCRIPT = Path(__file__).with_name("tritonclient_script.py")


def reference_scores(module: torch.jit.ScriptModule, rows: list[list[float]]) -> np.ndarray:
    with torch.inference_mode():
        return module(torch.tensor(rows, dtype=torch.float32)).numpy()


@pytest.fixture(scope="module")
def triton_python() -> Path:
    if not TRITON_PYTHON.exists():
        pytest.fail(
            f"{TRITON_PYTHON.relative_to(REPO)} is missing: `make test` creates it, or run "
            "`make triton-venv` (a venv holding tritonclient[grpc], kept apart because it pins "
            "an older grpcio/protobuf)"
        )
    return TRITON_PYTHON


async def test_tritonclient_works_unchanged(
    triton_python: Path,
    artifacts: dict[int, Artifact],
    reference: dict[int, torch.jit.ScriptModule],
) -> None:
    servicer = InferenceServicer(
        replica=REPLICA, loader=demo_loader(artifacts), expected=[("fraud", "v1"), ("fraud", "v2")]
    )
    await servicer.repository.load_all()
    server = ServiceServer(REPLICA, port=0, drain_grace_s=1.0)
    server.add_service(
        grpc_service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, servicer, SERVICE_NAME
    )
    server.on_stop(servicer.repository.close)
    port = await server.start()
    try:
        client = await asyncio.create_subprocess_exec(
            str(triton_python),
            str(SCRIPT),
            f"127.0.0.1:{port}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(client.communicate(), timeout=120)
    finally:
        await server.drain()
    assert client.returncode == 0, stderr.decode()[-3000:]
    seen = json.loads(stdout.decode().strip().splitlines()[-1])

    assert seen["live"] and seen["ready"] and seen["model_ready"] and seen["v1_ready"]
    assert not seen["v9_ready"]
    assert seen["server_metadata"]["name"] == "servemesh"
    metadata = seen["model_metadata"]
    assert metadata["name"] == "fraud" and metadata["versions"] == ["v1", "v2"]
    assert metadata["inputs"] == [{"name": "features", "datatype": "FP32", "shape": ["-1", "64"]}]
    assert metadata["outputs"] == [{"name": "score", "datatype": "FP32", "shape": ["-1", "1"]}]

    expected = reference_scores(reference[1], seen["inputs"])
    rtol, atol = 1e-5, 1e-6
    np.testing.assert_allclose(seen["raw_scores"], expected, rtol=rtol, atol=atol)
    np.testing.assert_allclose(seen["with_parameters"], expected[:1], rtol=rtol, atol=atol)
    typed = np.reshape(seen["typed_scores"], (3, 1))
    np.testing.assert_allclose(typed, expected, rtol=rtol, atol=atol)
    assert seen["typed_raw_outputs"] == 0  # typed in, typed out
    assert len(seen["async_answers"]) == 16
    for index, answer in enumerate(seen["async_answers"]):
        row = expected[index % 3 : index % 3 + 1]
        np.testing.assert_allclose(answer, row, rtol=rtol, atol=atol)

    assert seen["wrong_shape"] == {
        "status": "StatusCode.INVALID_ARGUMENT",
        "message": "inputs[0].shape: expected [-1, 64], got [1, 63]",
    }
    assert seen["wrong_datatype"] == {
        "status": "StatusCode.INVALID_ARGUMENT",
        "message": "inputs[0].datatype: expected FP32, got FP64",
    }
    assert seen["unknown_model"] == {
        "status": "StatusCode.NOT_FOUND",
        "message": "model 'nope' is not loaded",
    }
    assert seen["unknown_version"] == {
        "status": "StatusCode.NOT_FOUND",
        "message": "model 'fraud' version 'v9' is not loaded; loaded: ['v1', 'v2']",
    }
    assert seen["metadata_unknown_model"]["status"] == "StatusCode.NOT_FOUND"

    stats = seen["statistics"]
    assert (stats["name"], stats["version"]) == ("fraud", "v1")
    assert int(stats["inference_count"]) == 3 + 1 + 3 + 16  # rows answered
    assert 1 <= int(stats["execution_count"]) <= 3 + 16


def test_the_client_script_imports_nothing_from_servemesh() -> None:
    # Compatibility means tritonclient alone: the script must not lean on our code.
    text = SCRIPT.read_text()
    assert "servemesh" not in text.split('"""', 2)[2].replace("servemesh's venv", "")
    assert sys.executable != str(TRITON_PYTHON)
