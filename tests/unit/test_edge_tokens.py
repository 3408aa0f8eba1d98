"""Edge tokens and the edge-auth spec, without a network: the signing key and JWKS `up`
creates, the tokens `servemesh auth token` issues, and what the gateway believes about a
caller (services/gateway/callers.py)."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import grpc
import pytest
import yaml
from pydantic import ValidationError

from servemesh.cli import build_parser, main
from servemesh.cli.auth import cmd_token, ttl_seconds
from servemesh.contract.wire import CALLER_HEADER, CALLER_ROLE_HEADER, CLIENT_CERT_HEADER
from servemesh.identity.tokens import (
    TokenError,
    audience_of,
    auth_dir,
    ensure_signing_key,
    issue_token,
    issuer_of,
    jwks_path,
    load_signing_key,
    read_jwks,
    signing_key_path,
    verify_token,
)
from servemesh.services.gateway.callers import (
    Caller,
    caller_from,
    check_pin,
    client_cert_uri,
)
from servemesh.services.gateway.predict import plan_predict
from servemesh.services.runtime.errors import PermissionDenied
from servemesh.spec import MeshSpec
from servemesh.spec.policy import EdgeAuth
from servemesh_api.gateway.v1 import gateway_pb2

JWT = EdgeAuth(mode="jwt")
MESH = "servemesh"


def test_the_signing_key_is_private_and_the_jwks_holds_only_its_public_half(
    tmp_path: Path,
) -> None:
    ensure_signing_key(tmp_path)
    assert stat.S_IMODE(signing_key_path(tmp_path).stat().st_mode) == 0o600
    assert stat.S_IMODE(auth_dir(tmp_path).stat().st_mode) == 0o700
    [key] = read_jwks(tmp_path)["keys"]
    assert key["kty"] == "EC" and key["crv"] == "P-256" and key["alg"] == "ES256"
    assert "d" not in key  # the private scalar never leaves the key file
    # A second `up` keeps the key (tokens issued before stay good).
    before = signing_key_path(tmp_path).read_bytes()
    ensure_signing_key(tmp_path)
    assert signing_key_path(tmp_path).read_bytes() == before
    assert json.loads(jwks_path(tmp_path).read_text())["keys"][0]["kid"] == key["kid"]


def test_a_token_verifies_with_the_mesh_issuer_audience_role_and_expiry(tmp_path: Path) -> None:
    ensure_signing_key(tmp_path)
    key = load_signing_key(tmp_path)
    token = issue_token(JWT, MESH, key, role="operator", subject="alice", ttl_s=600)
    verified = verify_token(JWT, MESH, read_jwks(tmp_path), token)
    assert (verified.role, verified.subject) == ("operator", "alice")
    claims = verified.claims
    assert claims["iss"] == issuer_of(JWT, MESH) and claims["aud"] == audience_of(JWT, MESH)
    assert claims["exp"] - claims["iat"] == 600


def test_expired_foreign_issuer_and_other_key_tokens_do_not_verify(tmp_path: Path) -> None:
    ensure_signing_key(tmp_path / "a")
    ensure_signing_key(tmp_path / "b")
    key = load_signing_key(tmp_path / "a")
    jwks = read_jwks(tmp_path / "a")
    expired = issue_token(JWT, MESH, key, role="caller", subject="x", ttl_s=60, now=0)
    with pytest.raises(TokenError, match="expired"):
        verify_token(JWT, MESH, jwks, expired)
    foreign = issue_token(JWT, MESH, key, role="caller", subject="x", issuer="urn:elsewhere")
    with pytest.raises(TokenError, match="issuer"):
        verify_token(JWT, MESH, jwks, foreign)
    other = issue_token(JWT, MESH, load_signing_key(tmp_path / "b"), role="caller", subject="x")
    with pytest.raises(TokenError, match="[Ss]ignature"):
        verify_token(JWT, MESH, jwks, other)


def test_unknown_roles_and_long_ttls_are_refused_naming_the_field(tmp_path: Path) -> None:
    ensure_signing_key(tmp_path)
    key = load_signing_key(tmp_path)
    with pytest.raises(TokenError, match=r"^role: 'root' is not one of traffic.edge_auth.roles"):
        issue_token(JWT, MESH, key, role="root", subject="x")
    with pytest.raises(TokenError, match=r"^ttl: .*max_token_ttl \(24h\)"):
        issue_token(JWT, MESH, key, role="caller", subject="x", ttl_s=2 * 86400)
    with pytest.raises(TokenError, match="^ttl: "):
        ttl_seconds("forever")


def test_auth_token_prints_a_token_of_the_running_state_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_file = tmp_path / "mesh.yaml"
    spec_file.write_text(yaml.safe_dump({"traffic": {"edge_auth": {"mode": "jwt"}}}))
    state = tmp_path / "state"
    ensure_signing_key(state)
    argv = ["auth", "token", "--role", "caller", "--subject", "svc-a", "--ttl", "15m"]
    argv += ["--spec", str(spec_file), "--state-dir", str(state)]
    assert cmd_token(build_parser().parse_args(argv)) == 0
    token = capsys.readouterr().out.strip()
    verified = verify_token(JWT, MESH, read_jwks(state), token)
    assert verified.subject == "svc-a" and verified.claims["exp"] - time.time() <= 900
    # A role the mesh does not have: bad input naming the field (exit status 1).
    assert main([*argv[:3], "admin", *argv[4:]]) == 1
    assert "role: 'admin'" in capsys.readouterr().err


def test_edge_auth_keeps_enabled_as_basic_and_refuses_contradictions() -> None:
    assert EdgeAuth(enabled=True).active_mode == "basic"
    assert EdgeAuth().active_mode == "off"
    # YAML 1.1 reads a bare `off` as false.
    assert EdgeAuth.model_validate(yaml.safe_load("{mode: off}")).active_mode == "off"
    with pytest.raises(ValidationError, match="enabled: true means mode basic"):
        EdgeAuth(mode="jwt", enabled=True)
    with pytest.raises(ValidationError, match="pin_roles"):
        EdgeAuth(pin_roles=["root"])


# --- what the gateway believes ------------------------------------------------------------

SPEC = MeshSpec()  # fraud: v1 100%, v2 0%
ENVOY = {"peer_spiffe_id": [b"spiffe://servemesh/envoy"]}
OPERATOR = {"peer_spiffe_id": [b"spiffe://servemesh/operator"]}
FEATURE = {"peer_spiffe_id": [b"spiffe://servemesh/feature-zone-a-0"]}
XFCC_OPERATOR = 'By=spiffe://servemesh/edge;Hash=ab12;URI="spiffe://servemesh/operator"'


def _pin(caller: Caller, version: str = "v2") -> None:
    check_pin(SPEC, "fraud", version, caller)


def test_role_and_certificate_headers_count_only_on_a_connection_from_envoy() -> None:
    forged = [(CALLER_ROLE_HEADER, "operator"), (CLIENT_CERT_HEADER, XFCC_OPERATOR)]
    direct = caller_from(SPEC, FEATURE, forged)
    assert direct == Caller(peer="spiffe://servemesh/feature-zone-a-0")
    with pytest.raises(PermissionDenied, match=r"^version: pinning 'v2'"):
        _pin(direct)
    with pytest.raises(PermissionDenied):
        _pin(caller_from(SPEC, {}, forged))  # a plaintext port: nobody
    via_edge = caller_from(SPEC, ENVOY, [(CALLER_ROLE_HEADER, "operator"), (CALLER_HEADER, "al")])
    assert via_edge.via_edge and via_edge.subject == "al"
    _pin(via_edge)


def test_pinning_a_version_at_zero_needs_a_pin_role_or_the_operator_certificate() -> None:
    with pytest.raises(PermissionDenied) as refused:
        _pin(caller_from(SPEC, ENVOY, [(CALLER_ROLE_HEADER, "caller")]))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "v1" not in refused.value.message  # names nothing the caller did not send
    _pin(caller_from(SPEC, ENVOY, [(CLIENT_CERT_HEADER, XFCC_OPERATOR)]))
    _pin(caller_from(SPEC, OPERATOR, []))  # the operator on the gateway's own port
    # A version with a share of the split, and no pin at all, are anyone's.
    _pin(Caller(), "v1")
    _pin(Caller(), "")


def test_the_client_certificate_header_names_the_current_element_s_uri() -> None:
    assert client_cert_uri(XFCC_OPERATOR) == "spiffe://servemesh/operator"
    assert client_cert_uri("By=a;URI=spiffe://x/one,By=b;URI=spiffe://x/two") == "spiffe://x/two"
    assert client_cert_uri("Hash=ab") == ""


def test_not_found_names_what_the_caller_sent_and_never_the_catalogue() -> None:
    from servemesh.services.runtime.errors import NotFound

    with pytest.raises(NotFound) as model:
        plan_predict(gateway_pb2.PredictRequest(model="nope", entity_ids=["u"]), SPEC)
    assert model.value.message == "model: 'nope' is not served"
    with pytest.raises(NotFound) as version:
        plan_predict(gateway_pb2.PredictRequest(model="fraud", version="v9"), SPEC)
    assert version.value.message == "version: model 'fraud' has no version 'v9'"
