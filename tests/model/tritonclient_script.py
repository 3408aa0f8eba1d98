"""Drives a model server with NVIDIA's tritonclient, unchanged; prints what it saw as JSON.

Run by tests/model/test_model_tritonclient.py with the interpreter of .venv-triton (tritonclient
pins an older grpcio/protobuf than servemesh, so it cannot share servemesh's venv):

    .venv-triton/bin/python tests/model/tritonclient_script.py 127.0.0.1:PORT

It imports nothing from servemesh. Every call that should fail is caught and reported with
its status and message, so the test can assert on both.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

MODEL = "fraud"


def infer_raw(
    client: grpcclient.InferenceServerClient, batch: np.ndarray, **kwargs: Any
) -> np.ndarray:
    """ModelInfer with raw_input_contents (tritonclient's way); reads raw_output_contents."""
    tensor = grpcclient.InferInput("features", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)
    result = client.infer(
        MODEL, [tensor], outputs=[grpcclient.InferRequestedOutput("score")], **kwargs
    )
    scores = result.as_numpy("score")
    assert scores is not None
    response = result.get_response()
    assert len(response.raw_output_contents) == 1
    return scores


def failure(call: Any) -> dict[str, str]:
    try:
        call()
    except InferenceServerException as exc:
        return {"status": str(exc.status()), "message": str(exc.message())}
    return {"status": "OK", "message": ""}


def main(url: str) -> dict[str, Any]:
    client = grpcclient.InferenceServerClient(url)
    out: dict[str, Any] = {
        "live": client.is_server_live(),
        "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(MODEL),
        "v1_ready": client.is_model_ready(MODEL, "v1"),
        "v9_ready": client.is_model_ready(MODEL, "v9"),
        "server_metadata": client.get_server_metadata(as_json=True),
        "model_metadata": client.get_model_metadata(MODEL, as_json=True),
    }
    rng = np.random.default_rng(7)
    batch = rng.normal(size=(3, 64)).astype(np.float32)
    out["inputs"] = batch.tolist()
    out["raw_scores"] = infer_raw(client, batch, model_version="v1").tolist()
    # OIP parameters tritonclient sets: priority (uint64) and timeout (microseconds).
    out["with_parameters"] = infer_raw(
        client, batch[:1], model_version="v1", priority=1, timeout=2_000_000, client_timeout=5.0
    ).tolist()

    # Typed contents (fp32_contents) through tritonclient's own generated stubs.
    request = service_pb2.ModelInferRequest(model_name=MODEL, model_version="v1")
    tensor = request.inputs.add(name="features", datatype="FP32", shape=list(batch.shape))
    tensor.contents.fp32_contents.extend(batch.ravel().tolist())
    with grpc.insecure_channel(url) as channel:
        typed = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=5)
    out["typed_scores"] = list(typed.outputs[0].contents.fp32_contents)
    out["typed_raw_outputs"] = len(typed.raw_output_contents)

    # Concurrent callers through async_infer: every answer arrives (they share batches),
    # in whatever order the callbacks run; each is filed under the request it answers.
    answers: dict[int, Any] = {}
    lock = threading.Lock()
    done = threading.Event()

    def collect(index: int, result: Any, error: Any) -> None:
        with lock:
            answers[index] = str(error) if error is not None else result.as_numpy("score").tolist()
            if len(answers) == 16:
                done.set()

    for index in range(16):
        tensor = grpcclient.InferInput("features", [1, 64], "FP32")
        tensor.set_data_from_numpy(batch[index % 3 : index % 3 + 1])
        client.async_infer(MODEL, [tensor], functools.partial(collect, index), model_version="v1")
    done.wait(timeout=30)
    out["async_answers"] = [answers.get(index, "no answer") for index in range(16)]

    wrong_shape = grpcclient.InferInput("features", [1, 63], "FP32")
    wrong_shape.set_data_from_numpy(np.zeros((1, 63), np.float32))
    out["wrong_shape"] = failure(lambda: client.infer(MODEL, [wrong_shape]))
    wrong_type = grpcclient.InferInput("features", [1, 64], "FP64")
    wrong_type.set_data_from_numpy(np.zeros((1, 64), np.float64))
    out["wrong_datatype"] = failure(lambda: client.infer(MODEL, [wrong_type]))
    good = grpcclient.InferInput("features", [1, 64], "FP32")
    good.set_data_from_numpy(batch[:1])
    out["unknown_model"] = failure(lambda: client.infer("nope", [good]))
    out["unknown_version"] = failure(lambda: client.infer(MODEL, [good], model_version="v9"))
    out["metadata_unknown_model"] = failure(lambda: client.get_model_metadata("nope"))

    stats = client.get_inference_statistics(MODEL, "v1", as_json=True)
    out["statistics"] = stats["model_stats"][0]
    client.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), default=str))
