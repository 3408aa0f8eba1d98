"""Edge auth callers can use, and versions callers cannot steer: observed through a real
Envoy edge in front of a real mesh.

`jwt_mesh` runs with `traffic.edge_auth.mode: jwt` (tokens signed by the mesh's own key);
`mesh` (tests/mesh/conftest.py) runs with edge auth off, where the client certificate is
the one credential. In both, fraud v2 has 0% of the traffic split.
"""

from __future__ import annotations

import shutil
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.bench.h2load import Measured, frame_file, measure_edge, predict_body, send_marker
from servemesh.bench.observe import BENCH_CALLER, cpu_by_kind
from servemesh.bench.predict import round_credentials
from servemesh.cli import main
from servemesh.contract.wire import AUTHORIZATION_HEADER, CALLER_ROLE_HEADER
from servemesh.identity import dial_edge, mesh_identity
from servemesh.identity.edge_client import dial_edge_as
from servemesh.identity.tokens import (
    DEFAULT_TTL_S,
    ensure_signing_key,
    issue_token,
    load_signing_key,
)
from servemesh.launcher import Mesh
from servemesh.proxy.admin import AdminClient
from servemesh.rollout.analysis import EndpointsSource, pinned_between, window
from servemesh.spec import ResolvedSpec
from servemesh.spec.policy import EdgeAuth, TrafficSpec
from servemesh.state.credentials import EdgeAuthMetadata
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import test_mesh_spec

Metadata = tuple[tuple[str, str], ...]


@pytest.fixture(scope="module")
def jwt_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = test_mesh_spec(str(tmp_path_factory.mktemp("jwt-mesh")), entities=100)
    spec = spec.model_copy(update={"traffic": TrafficSpec(edge_auth=EdgeAuth(mode="jwt"))})
    with Mesh.from_spec(spec) as running:
        yield running


def _token(
    spec: ResolvedSpec,
    role: str,
    *,
    key: ec.EllipticCurvePrivateKey | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    now: float | None = None,
    issuer: str | None = None,
) -> str:
    return issue_token(
        spec.traffic.edge_auth,
        spec.name,
        key or load_signing_key(spec.state_dir),
        role=role,
        subject=f"test-{role}",
        ttl_s=ttl_s,
        now=now,
        issuer=issuer,
    )


def _bearer(token: str) -> Metadata:
    return ((AUTHORIZATION_HEADER, f"Bearer {token}"),)


def _predict(
    spec: ResolvedSpec,
    metadata: Metadata = (),
    version: str = "",
    operator_cert: bool = False,
    model: str = "fraud",
) -> gateway_pb2.PredictResponse | grpc.RpcError:
    dial = dial_edge_as(spec, spec.edge_address) if operator_cert else dial_edge(spec)
    request = gateway_pb2.PredictRequest(model=model, entity_ids=["user-7"], version=version)
    with dial.channel() as channel:
        try:
            reply: gateway_pb2.PredictResponse = gateway_pb2_grpc.GatewayStub(channel).Predict(
                request, metadata=metadata, timeout=10
            )
        except grpc.RpcError as exc:
            return exc
    return reply


def _code(answer: gateway_pb2.PredictResponse | grpc.RpcError) -> grpc.StatusCode:
    return answer.code() if isinstance(answer, grpc.RpcError) else grpc.StatusCode.OK


# --- mode jwt -----------------------------------------------------------------------------


def test_no_token_or_a_bad_one_is_unauthenticated(jwt_mesh: Mesh, tmp_path: Path) -> None:
    spec = jwt_mesh.spec
    ensure_signing_key(tmp_path)
    bad = {
        "no token": (),
        "expired": _bearer(_token(spec, "caller", ttl_s=60, now=time.time() - 3600)),
        "another issuer": _bearer(_token(spec, "caller", issuer="urn:servemesh:elsewhere")),
        "another key": _bearer(_token(spec, "caller", key=load_signing_key(tmp_path))),
        "not a token": _bearer("not.a.token"),
        # A caller's own role header, with no token, gets nowhere.
        "forged role": ((CALLER_ROLE_HEADER, "operator"),),
    }
    codes = {name: _code(_predict(spec, metadata)) for name, metadata in bad.items()}
    assert codes == dict.fromkeys(bad, grpc.StatusCode.UNAUTHENTICATED)


def test_a_valid_token_predicts_and_health_check_stays_open(jwt_mesh: Mesh) -> None:
    spec = jwt_mesh.spec
    reply = _predict(spec, _bearer(_token(spec, "caller")))
    assert isinstance(reply, gateway_pb2.PredictResponse) and reply.model_version == "v1"
    with dial_edge(spec).channel() as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_rest_calls_meet_the_same_auth_401_without_a_token_403_pinning_at_zero(
    jwt_mesh: Mesh,
) -> None:
    """REST through the edge's transcoder is judged as the gRPC call it becomes: no token
    or a bad one is 401, a caller pinning a version the split gives 0% is 403, a valid
    token answers; each refusal says why (the token's fault in www-authenticate, the pin's
    in a JSON google.rpc.Status)."""
    spec = jwt_mesh.spec
    trust = ssl.create_default_context(cafile=str(mesh_identity(spec).trust_file))
    predict = "/v1/models/fraud:predict"
    body = {"entity_ids": ["user-1"]}
    with httpx.Client(base_url=f"https://{spec.edge_address}", verify=trust, timeout=10) as rest:
        assert rest.post(predict, json=body).status_code == 401
        bad = rest.post(predict, json=body, headers={"authorization": "Bearer not.a.token"})
        assert bad.status_code == 401, bad.text
        assert 'error="invalid_token"' in bad.headers["www-authenticate"], bad.headers
        caller = {"authorization": f"Bearer {_token(spec, 'caller')}"}
        pinned = rest.post(predict, json={**body, "version": "v2"}, headers=caller)
        assert pinned.status_code == 403, pinned.text
        assert pinned.json()["message"].startswith("version: "), pinned.text
        answered = rest.post(predict, json=body, headers=caller)
        assert answered.status_code == 200 and answered.json()["model_version"] == "v1"
        # OIP infer pinned at 0% is held to the same rule.
        infer = rest.post("/v2/models/fraud/versions/v2/infer", json={"inputs": [{"name": "x"}]},
                          headers=caller)  # fmt: skip
        assert infer.status_code == 403, infer.text


def test_only_a_pin_role_or_the_operator_certificate_pins_a_version_at_zero(
    jwt_mesh: Mesh,
) -> None:
    spec = jwt_mesh.spec
    caller = _bearer(_token(spec, "caller"))
    refused = _predict(spec, caller, version="v2")
    assert isinstance(refused, grpc.RpcError)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.details().startswith("version: ")
    # The caller's own copy of the role header never reaches the gateway.
    forged = _predict(spec, (*caller, (CALLER_ROLE_HEADER, "operator")), version="v2")
    assert _code(forged) == grpc.StatusCode.PERMISSION_DENIED
    # A version with a share of the split is anyone's to pin.
    assert _code(_predict(spec, caller, version="v1")) == grpc.StatusCode.OK
    by_role = _predict(spec, _bearer(_token(spec, "operator")), version="v2")
    assert isinstance(by_role, gateway_pb2.PredictResponse) and by_role.model_version == "v2"
    by_cert = _predict(spec, caller, version="v2", operator_cert=True)
    assert isinstance(by_cert, gateway_pb2.PredictResponse) and by_cert.model_version == "v2"


def test_pinned_calls_are_counted_apart_from_the_routed_ones(jwt_mesh: Mesh) -> None:
    spec = jwt_mesh.spec
    source = EndpointsSource(spec)
    before = source.snapshot("fraud", shadow=False)
    operator = _bearer(_token(spec, "operator"))
    for _ in range(5):
        assert _code(_predict(spec, operator, version="v2")) == grpc.StatusCode.OK
    assert _code(_predict(spec, operator)) == grpc.StatusCode.OK  # routed: v1
    after = source.snapshot("fraud", shadow=False)
    arms = window(before, after)
    # The canary's routed arm did not move; its pinned calls are reported apart.
    assert "v2" not in arms or arms["v2"].requests == 0
    assert arms["v1"].requests == 1
    assert pinned_between(before, after) == {"v2": 5}


def test_refusals_name_what_was_sent_and_never_the_catalogue(jwt_mesh: Mesh) -> None:
    spec = jwt_mesh.spec
    caller = _bearer(_token(spec, "caller"))
    model = _predict(spec, caller, model="nope")
    assert isinstance(model, grpc.RpcError) and model.code() == grpc.StatusCode.NOT_FOUND
    assert model.details() == "model: 'nope' is not served"
    version = _predict(spec, caller, version="v9")
    assert isinstance(version, grpc.RpcError)
    assert version.details() == "version: model 'fraud' has no version 'v9'"


# --- the mesh's own callers: load, the benchmarks ------------------------------------------


def test_servemesh_load_signs_its_own_token_at_a_jwt_edge(
    jwt_mesh: Mesh, capsys: pytest.CaptureFixture[str]
) -> None:
    state_dir = str(jwt_mesh.state_dir)
    code = main(["load", "--rate", "20", "--seconds", "1", "--state-dir", state_dir])
    printed = capsys.readouterr().out
    assert code == 0, printed
    cells = [[c.strip() for c in line.split("│") if c.strip()] for line in printed.splitlines()]
    rows = {row[0]: row[1] for row in cells if len(row) == 2}
    assert rows["answered"] == "20" and rows["failed"] == "0", printed


@pytest.mark.skipif(shutil.which("h2load") is None, reason="h2load is not installed")
def test_h2load_rounds_send_a_token_signed_for_the_round(jwt_mesh: Mesh, tmp_path: Path) -> None:
    spec = jwt_mesh.spec
    auth = EdgeAuthMetadata(spec, BENCH_CALLER)
    body = frame_file(tmp_path, "predict", predict_body("fraud", "user-1"))

    def measure(headers: list[tuple[str, str]]) -> Measured:
        return measure_edge(
            spec.edge_address,
            body,
            4,
            0.6,
            0.2,
            5.0,
            tls=spec.tls.edge,
            access_log=jwt_mesh.logs_dir / "envoy-edge-access.log",
            read_cpu=lambda: cpu_by_kind(jwt_mesh),
            marker=lambda: send_marker(dial_edge(spec), "fraud", "user-1", auth.metadata()),
            flush=lambda: AdminClient.of_mesh(jwt_mesh.state_dir).post("/reopen_logs"),
            connections=1,
            headers=headers,
        )

    signed = measure(round_credentials(auth, 0.8))
    assert signed.ok > 10 and signed.errors == {}
    unsigned = measure([])
    # Refused, and past the edge's bucket for callers it cannot name, shed as well.
    assert unsigned.ok == 0 and "UNAUTHENTICATED" in unsigned.errors
    assert set(unsigned.errors) <= {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED"}


# --- edge auth off: the client certificate alone ------------------------------------------


def test_without_edge_auth_only_the_operator_certificate_pins_a_version_at_zero(
    mesh: Mesh,
) -> None:
    spec = mesh.spec
    refused = _predict(spec, version="v2")
    assert _code(refused) == grpc.StatusCode.PERMISSION_DENIED
    forged = _predict(spec, ((CALLER_ROLE_HEADER, "operator"),), version="v2")
    assert _code(forged) == grpc.StatusCode.PERMISSION_DENIED
    pinned = _predict(spec, version="v2", operator_cert=True)
    assert isinstance(pinned, gateway_pb2.PredictResponse) and pinned.model_version == "v2"
