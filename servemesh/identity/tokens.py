"""Edge tokens: the mesh's own signing key, the JWKS Envoy verifies with, and tokens.

With `traffic.edge_auth.mode: jwt` the edge asks every caller (health checks aside) for
`authorization: Bearer <token>`: an ES256 JWT signed by this mesh's key, naming this mesh's
issuer and audience, carrying an expiry and a `role` from the spec's `roles`. Envoy's
jwt_authn filter checks the signature against the public JWKS (`<state_dir>/auth/jwks.json`),
then the issuer, audience and expiry, and passes the verified `role` and `sub` on to the
gateway in CALLER_ROLE_HEADER and CALLER_HEADER (servemesh/contract/wire.py).

`servemesh up` creates the key once (`<state_dir>/auth/signing-key.pem`, mode 0600, in a
0700 folder); `servemesh auth token` signs with it. Nothing here touches the network.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jwt
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm

from servemesh.contract.errors import ServemeshError
from servemesh.spec.durations import duration_seconds
from servemesh.spec.policy import EdgeAuth

if TYPE_CHECKING:
    from servemesh.spec import MeshSpec

AUTH_DIR = "auth"
SIGNING_KEY_FILE = "signing-key.pem"
JWKS_FILE = "jwks.json"
ALGORITHM = "ES256"
# The claim that names a token's role (and the one Envoy copies into CALLER_ROLE_HEADER).
ROLE_CLAIM = "role"
SUBJECT_CLAIM = "sub"
DEFAULT_TTL_S = 3600.0


class TokenError(ServemeshError, ValueError):
    """A token that cannot be issued or does not verify; the message names the field."""


def auth_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / AUTH_DIR


def signing_key_path(state_dir: str | Path) -> Path:
    return auth_dir(state_dir) / SIGNING_KEY_FILE


def jwks_path(state_dir: str | Path) -> Path:
    return auth_dir(state_dir) / JWKS_FILE


def issuer_of(auth: EdgeAuth, mesh: str) -> str:
    """The `iss` every token of this mesh names (the spec's, else one from the mesh name)."""
    return auth.issuer or f"urn:servemesh:{mesh}"


def audience_of(auth: EdgeAuth, mesh: str) -> str:
    """The `aud` the edge accepts (the spec's, else one from the mesh name)."""
    return auth.audience or f"urn:servemesh:{mesh}:edge"


def _public_jwk(key: ec.EllipticCurvePublicKey) -> dict[str, Any]:
    jwk: dict[str, Any] = json.loads(ECAlgorithm.to_jwk(key))
    # RFC 7638 thumbprint as the key id: the same key always gets the same id.
    canonical = json.dumps(
        {k: jwk[k] for k in ("crv", "kty", "x", "y")}, separators=(",", ":"), sort_keys=True
    )
    digest = hashes.Hash(hashes.SHA256())
    digest.update(canonical.encode())
    kid = base64.urlsafe_b64encode(digest.finalize()).rstrip(b"=").decode()
    return {**jwk, "kid": kid, "use": "sig", "alg": ALGORITHM}


def jwks_of(key: ec.EllipticCurvePrivateKey) -> dict[str, Any]:
    """The public JWKS of `key` (what Envoy verifies tokens with)."""
    return {"keys": [_public_jwk(key.public_key())]}


def _write_private(path: Path, data: bytes) -> None:
    # O_EXCL + 0600 at creation: the key is never readable by others, even for a moment.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    tmp.replace(path)


def _write_public(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    tmp.write_text(text)
    tmp.chmod(0o644)
    tmp.replace(path)  # Envoy and readers see the old file or the new one, never half


def ensure_signing_key(state_dir: str | Path) -> Path:
    """The mesh's token signing key (P-256), created on first use; the public JWKS beside it
    is (re)written to match. Returns the JWKS file."""
    folder = auth_dir(state_dir)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder.chmod(0o700)
    key_file = folder / SIGNING_KEY_FILE
    if not key_file.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        _write_private(
            key_file,
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
    key = load_signing_key(state_dir)
    jwks = json.dumps(jwks_of(key), sort_keys=True)
    target = folder / JWKS_FILE
    if not target.exists() or target.read_text() != jwks:
        _write_public(target, jwks)
    return target


def load_signing_key(state_dir: str | Path) -> ec.EllipticCurvePrivateKey:
    path = signing_key_path(state_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TokenError(
            f"no signing key at {path}: start the mesh with traffic.edge_auth.mode jwt "
            "(`servemesh up` creates it)"
        ) from None
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise TokenError(f"{path}: not an EC private key")
    return key


def issue_token(
    auth: EdgeAuth,
    mesh: str,
    key: ec.EllipticCurvePrivateKey,
    *,
    role: str,
    subject: str,
    ttl_s: float = DEFAULT_TTL_S,
    now: float | None = None,
    issuer: str | None = None,
) -> str:
    """A signed token for `role` (one of the spec's roles) valid `ttl_s` seconds.
    `issuer` overrides the mesh's (only tests want a token of another issuer)."""
    if role not in auth.roles:
        raise TokenError(f"role: {role!r} is not one of traffic.edge_auth.roles {auth.roles}")
    if not subject or len(subject) > 128 or not subject.isprintable():
        raise TokenError("subject: 1 to 128 printable characters")
    limit = duration_seconds(auth.max_token_ttl)
    if not 0 < ttl_s <= limit:
        raise TokenError(
            f"ttl: {ttl_s:g} s; a token lives more than 0 s and at most "
            f"traffic.edge_auth.max_token_ttl ({auth.max_token_ttl})"
        )
    issued = int(time.time() if now is None else now)
    claims = {
        "iss": issuer or issuer_of(auth, mesh),
        "aud": audience_of(auth, mesh),
        SUBJECT_CLAIM: subject,
        ROLE_CLAIM: role,
        "iat": issued,
        "nbf": issued,
        "exp": issued + int(ttl_s),
        "jti": secrets.token_urlsafe(12),
    }
    kid = _public_jwk(key.public_key())["kid"]
    return jwt.encode(claims, key, algorithm=ALGORITHM, headers={"kid": kid})


def mint_token(spec: MeshSpec, role: str, subject: str, ttl_s: float) -> str:
    """A token of `spec`'s mesh for `role`, signed with the key in its state dir
    (TokenError naming the field when refused)."""
    key = load_signing_key(spec.state_dir)
    return issue_token(
        spec.traffic.edge_auth, spec.name, key, role=role, subject=subject, ttl_s=ttl_s
    )


@dataclass(frozen=True)
class VerifiedToken:
    role: str
    subject: str
    claims: Mapping[str, Any]


def verify_token(
    auth: EdgeAuth, mesh: str, jwks: Mapping[str, Any], token: str, *, leeway_s: float = 0
) -> VerifiedToken:
    """What the edge checks, in Python (for tools and tests): signature by a key of `jwks`,
    issuer, audience, expiry required, and a role among the spec's."""
    try:
        header = jwt.get_unverified_header(token)
        keys = {k.get("kid"): k for k in jwks.get("keys", [])}
        jwk = keys.get(header.get("kid")) or next(iter(keys.values()), None)
        if jwk is None:
            raise TokenError("token: no verification key")
        public = ECAlgorithm.from_jwk(json.dumps(jwk))
        claims = jwt.decode(
            token,
            public,  # type: ignore[arg-type]
            algorithms=[ALGORITHM],
            issuer=issuer_of(auth, mesh),
            audience=audience_of(auth, mesh),
            leeway=leeway_s,
            options={"require": ["exp", "iss", "aud", "sub"]},
        )
    except jwt.PyJWTError as exc:
        raise TokenError(f"token: {exc}") from None
    role = claims.get(ROLE_CLAIM)
    if role not in auth.roles:
        raise TokenError(f"token: role {role!r} is not one of {auth.roles}")
    return VerifiedToken(str(role), str(claims[SUBJECT_CLAIM]), claims)


def read_jwks(state_dir: str | Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(jwks_path(state_dir).read_text())
    return data
