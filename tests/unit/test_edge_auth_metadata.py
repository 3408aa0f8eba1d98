"""What the mesh's own callers of the edge send there (`servemesh load`, the benchmarks,
the stream consumer, the capacity plan), without a network: nothing with edge auth off,
the mesh's basic key, or a token signed with the mesh's key that the edge would accept;
and what `bench predict --client h2load` puts on h2load's command line."""

from __future__ import annotations

import base64
from pathlib import Path

import jwt
import pytest

from servemesh.bench.model import h2load
from servemesh.bench.predict import ROUND_TOKEN_MARGIN_S, check_h2load_fits, round_credentials
from servemesh.contract.errors import UsageError
from servemesh.contract.wire import AUTHORIZATION_HEADER
from servemesh.identity.tokens import ensure_signing_key, read_jwks, verify_token
from servemesh.spec import MeshSpec
from servemesh.spec.policy import EdgeAuth, TrafficSpec
from servemesh.state.credentials import SELF_TOKEN_TTL_S, EdgeAuthMetadata, ensure_edge_credentials


def _spec(state_dir: Path, auth: EdgeAuth) -> MeshSpec:
    return MeshSpec().model_copy(
        update={"state_dir": str(state_dir), "traffic": TrafficSpec(edge_auth=auth)}
    )


def _token_of(metadata: list[tuple[str, str]]) -> str:
    [(name, value)] = metadata
    assert name == AUTHORIZATION_HEADER and value.startswith("Bearer ")
    return value.removeprefix("Bearer ")


def _lifetime_s(token: str) -> int:
    claims = jwt.decode(token, options={"verify_signature": False})
    return int(claims["exp"]) - int(claims["iat"])


def test_with_edge_auth_off_nothing_is_sent(tmp_path: Path) -> None:
    assert EdgeAuthMetadata(_spec(tmp_path, EdgeAuth()), "servemesh-load").metadata() == []


def test_basic_mode_sends_the_mesh_s_own_key(tmp_path: Path) -> None:
    user, key = ensure_edge_credentials(tmp_path)
    [(name, value)] = EdgeAuthMetadata(
        _spec(tmp_path, EdgeAuth(mode="basic")), "servemesh-load"
    ).metadata()
    assert name == AUTHORIZATION_HEADER
    assert base64.b64decode(value.removeprefix("Basic ")).decode() == f"{user}:{key}"


def test_jwt_mode_signs_a_token_the_edge_accepts_and_reuses_it(tmp_path: Path) -> None:
    ensure_signing_key(tmp_path)
    spec = _spec(tmp_path, EdgeAuth(mode="jwt"))
    auth = EdgeAuthMetadata(spec, "servemesh-bench")
    token = _token_of(auth.metadata())
    verified = verify_token(spec.traffic.edge_auth, spec.name, read_jwks(tmp_path), token)
    assert verified.subject == "servemesh-bench"
    assert verified.role == spec.traffic.edge_auth.roles[0]
    assert _lifetime_s(token) == SELF_TOKEN_TTL_S
    # Signed once, sent until it nears its expiry (a load signs no token per call).
    assert _token_of(auth.metadata()) == token


def test_a_token_lives_no_longer_than_the_spec_allows(tmp_path: Path) -> None:
    ensure_signing_key(tmp_path)
    auth = EdgeAuthMetadata(_spec(tmp_path, EdgeAuth(mode="jwt", max_token_ttl="2m")), "x")
    assert auth.token_ttl_s() == 120
    assert _lifetime_s(_token_of(auth.metadata())) == 120


def test_an_h2load_round_gets_a_token_for_that_round_alone(tmp_path: Path) -> None:
    ensure_signing_key(tmp_path)
    auth = EdgeAuthMetadata(_spec(tmp_path, EdgeAuth(mode="jwt")), "servemesh-bench")
    token = _token_of(round_credentials(auth, 8.0))
    assert _lifetime_s(token) == 8 + ROUND_TOKEN_MARGIN_S
    # A new one each round: none outlives the round it was signed for.
    assert _token_of(round_credentials(auth, 8.0)) != token
    off = EdgeAuthMetadata(_spec(tmp_path, EdgeAuth()), "servemesh-bench")
    assert round_credentials(off, 8.0) == []


def test_basic_credentials_never_go_on_h2load_s_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(h2load, "h2load_path", lambda: "/usr/bin/h2load")
    spec = _spec(tmp_path, EdgeAuth(mode="basic"))
    with pytest.raises(UsageError, match="command line.*--client python"):
        check_h2load_fits(spec, "demo", direct=False, tls_cost=False)
    with pytest.raises(UsageError, match="never go on a command line"):
        round_credentials(EdgeAuthMetadata(spec, "servemesh-bench"), 8.0)
    check_h2load_fits(_spec(tmp_path, EdgeAuth(mode="jwt")), "demo", direct=False, tls_cost=False)
