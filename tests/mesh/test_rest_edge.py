"""REST/JSON at the edge, through a real Envoy's gRPC-JSON transcoder in front of the real
mesh (the package's mesh: edge auth off, TLS on): the gateway's Predict and the Open
Inference Protocol's REST paths, called with httpx over HTTP/1.1 and with curl, answered
as the same call over gRPC is; a bad body is a 4xx naming what was wrong, never a 500.
Edge auth over REST (401, 403) is tested on the jwt mesh: tests/mesh/test_edge_auth.py."""

from __future__ import annotations

import json
import ssl
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from google.protobuf import json_format

from servemesh.identity import dial_edge, mesh_identity
from servemesh.launcher import Mesh
from servemesh.observe.scrape import scrape, sum_by
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

pytestmark = pytest.mark.mesh


def base_url(mesh: Mesh) -> str:
    return f"https://{mesh.spec.edge_address}"


def fraud_inputs(described: dict[str, Any], rows: int, value: float) -> list[dict[str, Any]]:
    """OIP JSON inputs of `rows` rows of `value` for the model `described` (its metadata)."""
    [tensor] = described["inputs"]
    width = int(tensor["shape"][-1])
    return [
        {
            "name": tensor["name"],
            "datatype": "FP32",
            "shape": [rows, width],
            "contents": {"fp32_contents": [value] * (rows * width)},
        }
    ]


@pytest.fixture(scope="module")
def rest(mesh: Mesh) -> Iterator[httpx.Client]:
    """A REST client of the edge over HTTP/1.1, trusting the mesh's CA."""
    trust = ssl.create_default_context(cafile=str(mesh_identity(mesh.spec).trust_file))
    with httpx.Client(base_url=base_url(mesh), verify=trust, timeout=10.0) as client:
        yield client


def test_predict_over_rest_answers_as_grpc_does(mesh: Mesh, rest: httpx.Client) -> None:
    body = {"entity_ids": ["user-1", "user-2"], "version": "v1"}
    answered = rest.post("/v1/models/fraud:predict", json=body)
    assert answered.status_code == 200, answered.text
    assert answered.http_version == "HTTP/1.1"
    assert answered.headers["content-type"] == "application/json"
    via_rest = answered.json()
    with dial_edge(mesh.spec).channel() as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Predict(
            gateway_pb2.PredictRequest(
                model="fraud", entity_ids=["user-1", "user-2"], version="v1"
            ),
            timeout=10,
        )
    # The REST answer read back into the message: the same float32s, however printed.
    parsed = json_format.ParseDict(via_rest, gateway_pb2.PredictResponse())
    # Each call has its own request id, and either zone's replica may answer it; the rest
    # is the same answer.
    for answer in (parsed, reply):
        assert answer.request_id and answer.model_replica and answer.model_zone
        answer.ClearField("request_id")
        answer.ClearField("model_replica")
        answer.ClearField("model_zone")
    assert parsed == reply
    assert via_rest["model_version"] == "v1" and len(via_rest["scores"]) == 2


def test_the_oip_rest_paths_answer_health_metadata_and_infer(
    mesh: Mesh, rest: httpx.Client
) -> None:
    assert rest.get("/v2/health/live").json() == {"live": True}
    assert rest.get("/v2/health/ready").json() == {"ready": True}
    assert rest.get("/v2/models/fraud/ready").json() == {"ready": True}
    assert rest.get("/v2/models/fraud/versions/v1/ready").json() == {"ready": True}
    assert rest.get("/v2").json()["name"] == "servemesh"
    metadata = rest.get("/v2/models/fraud")
    assert metadata.status_code == 200, metadata.text
    described = metadata.json()
    assert described["name"] == "fraud" and described["inputs"], described
    inputs = fraud_inputs(described, rows=2, value=0.25)
    answered = rest.post("/v2/models/fraud/versions/v1/infer", json={"inputs": inputs})
    assert answered.status_code == 200, answered.text
    via_rest = answered.json()
    request = json_format.ParseDict(
        {"model_name": "fraud", "model_version": "v1", "inputs": inputs}, oip.ModelInferRequest()
    )
    with dial_edge(mesh.spec).channel() as channel:
        reply = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=10
        )
    parsed = json_format.ParseDict(via_rest, oip.ModelInferResponse())
    # The tensors, and which model and version answered (the replica, in `parameters`,
    # may differ).
    assert (parsed.model_name, parsed.model_version) == (reply.model_name, reply.model_version)
    assert list(parsed.outputs) == list(reply.outputs)
    assert list(parsed.raw_output_contents) == list(reply.raw_output_contents)
    assert via_rest["model_name"] == "fraud" and via_rest["model_version"] == "v1"


@pytest.mark.parametrize(
    ("path", "body", "status", "said"),
    [
        # Not JSON at all: the transcoder's parser says where.
        ("/v1/models/fraud:predict", "{not json", 400, ""),
        # JSON of the wrong type for a field.
        ("/v1/models/fraud:predict", '{"entity_ids": 5}', 400, "entity_ids"),
        # Valid JSON the gateway refuses, naming the field.
        ("/v1/models/fraud:predict", "{}", 400, "entity_ids"),
        ("/v1/models/nosuch:predict", '{"entity_ids": ["user-1"]}', 404, "nosuch"),
        ("/v2/models/fraud/infer", "{}", 400, "inputs"),
        ("/v2/models/nosuch/infer", '{"inputs": [{"name": "x"}]}', 404, "model_name"),
        ("/v2/models/fraud/versions/v9/infer", '{"inputs": [{"name": "x"}]}', 404, "v9"),
        # A queue level is the mesh's to give, not an edge caller's.
        (
            "/v2/models/fraud/infer",
            '{"inputs": [{"name": "x"}], "parameters": {"priority": {"int64_param": "1"}}}',
            400,
            "priority",
        ),
        # A path no binding names; a control call's gRPC path sent as REST is refused by
        # the edge's control-call denial before the transcoder sees it.
        ("/v2/models/fraud/load", "{}", 404, "Could not resolve"),
        ("/inference.GRPCInferenceService/RepositoryModelLoad", "{}", 403, "RBAC"),
    ],
)
def test_a_bad_request_is_a_4xx_naming_what_was_wrong(
    rest: httpx.Client, path: str, body: str, status: int, said: str
) -> None:
    answered = rest.post(path, content=body, headers={"content-type": "application/json"})
    assert answered.status_code == status, (answered.status_code, answered.text)
    assert said in answered.text, answered.text


def test_a_body_over_the_edge_s_limit_is_413(mesh: Mesh, rest: httpx.Client) -> None:
    limit = mesh.spec.limits.max_message_bytes
    ids = json.dumps({"entity_ids": ["u" * 1000] * (limit // 1000 + 10)})
    assert len(ids) > limit
    answered = rest.post(
        "/v1/models/fraud:predict", content=ids, headers={"content-type": "application/json"}
    )
    assert answered.status_code == 413, (answered.status_code, answered.text[:300])


def test_curl_predicts_over_rest(mesh: Mesh) -> None:
    done = subprocess.run(
        [
            "curl", "--silent", "--show-error", "--fail-with-body",
            "--cacert", str(mesh_identity(mesh.spec).trust_file),
            "-H", "content-type: application/json",
            "-d", '{"entity_ids": ["user-7"]}',
            f"{base_url(mesh)}/v1/models/fraud:predict",
        ],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    answer = json.loads(done.stdout)
    assert len(answer["scores"]) == 1 and answer["model_version"], answer


def _oip_counts(mesh: Mesh) -> dict[tuple[str, ...], float]:
    """The gateways' OIP ModelInfer counts (and timings), summed over every gateway."""
    counts: dict[tuple[str, ...], float] = {}
    for instance in mesh.spec.instances():
        if instance.service != "gateway":
            continue
        samples = scrape(mesh.spec.metrics_address_of(instance.name))
        for name, labels in (
            ("servemesh_gateway_oip_infers_total", ("model", "version", "code", "route")),
            ("servemesh_gateway_oip_infer_duration_seconds_count", ("model", "version", "route")),
        ):
            for key, value in sum_by(samples, name, labels).items():
                counts[(name, *key)] = counts.get((name, *key), 0.0) + value
    return counts


def test_oip_calls_are_counted_by_model_version_and_route_for_the_slo(
    mesh: Mesh, rest: httpx.Client
) -> None:
    inputs = fraud_inputs(rest.get("/v2/models/fraud").json(), rows=1, value=0.5)
    before = _oip_counts(mesh)
    for path in ("/v2/models/fraud/infer", "/v2/models/fraud/versions/v1/infer"):
        answered = rest.post(path, json={"inputs": inputs})
        assert answered.status_code == 200, answered.text
    # A call refused before it reached a model is the caller's, not the model's: uncounted.
    assert rest.post("/v2/models/fraud/infer", json={}).status_code == 400
    after = _oip_counts(mesh)
    grown = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    calls, timed = (
        "servemesh_gateway_oip_infers_total",
        ("servemesh_gateway_oip_infer_duration_seconds_count"),
    )
    assert grown == {
        (calls, "fraud", "v1", "OK", "routed"): 1.0,
        (calls, "fraud", "v1", "OK", "pinned"): 1.0,
        (timed, "fraud", "v1", "routed"): 1.0,
        (timed, "fraud", "v1", "pinned"): 1.0,
    }, grown
