"""The control credential: a random token per mesh, kept in a 0600 file in the state dir.

Calls that change what the mesh serves (`wire.CONTROL_METHODS`) are answered only to a
caller that sends `authorization: Bearer <token>`. Every legitimate caller (the CLI,
`servemesh apply`, the demo seeding, the drills) reads the token from the state dir. The
services hold no token: each gets only its SHA-256 digest (`control_verifier`; `servemesh
up` hands it over in the environment, `SERVEMESH_CONTROL_SHA256`) and checks a call by
hashing the bearer it presents. So a service taken over (a hostile model file in a model
server) has nothing to replay against the registry or another service. The gateway has no
control method and gets not even the digest. The token is never logged, printed or put in
an error message; a token file another user owns, or that group or others may read, is
refused (servemesh.contract.private.PrivacyError, with the fix in the message).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from servemesh.contract.errors import ServemeshError
from servemesh.contract.private import check_secret
from servemesh.contract.wire import AUTHORIZATION_HEADER

CONTROL_TOKEN_FILE = "control-token"
BEARER_PREFIX = "Bearer "
# The environment variable `servemesh up` gives a service the token's digest in.
CONTROL_VERIFIER_ENV = "SERVEMESH_CONTROL_SHA256"
# A verifier (what a service holds) is this prefix and the token's SHA-256 digest in hex.
VERIFIER_PREFIX = "sha256:"

Metadata = tuple[tuple[str, str], ...]


class ControlCredentialMissing(ServemeshError, FileNotFoundError):
    """The state dir holds no control credential: no mesh was started there."""


def control_token_path(state_dir: Path | str) -> Path:
    return Path(state_dir) / CONTROL_TOKEN_FILE


def ensure_control_token(state_dir: Path | str) -> str:
    """The mesh's control token, created on first use with owner-only permissions and
    reused afterwards (a restart of the same state dir keeps it)."""
    existing = read_control_token(state_dir)
    if existing is not None:
        return existing
    path = control_token_path(state_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # O_EXCL + 0600 at creation: the token is never readable by others, even for a moment.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token


def read_control_token(state_dir: Path | str) -> str | None:
    """The token kept in `state_dir`, or None when there is none (or it is empty).
    PrivacyError when another user owns the file or others may read it."""
    path = control_token_path(state_dir)
    check_secret(path)
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        return None
    return token or None


def control_metadata(token: str) -> Metadata:
    """The call metadata that carries `token` on a control call."""
    return ((AUTHORIZATION_HEADER, BEARER_PREFIX + token),)


def control_metadata_for(state_dir: Path | str) -> Metadata:
    """The control call metadata of the mesh whose state dir is `state_dir`."""
    token = read_control_token(state_dir)
    if token is None:
        raise ControlCredentialMissing(
            f"no control credential in {state_dir} ({CONTROL_TOKEN_FILE}): "
            "is a mesh running there? start it with `servemesh up`"
        )
    return control_metadata(token)


def token_digest(token: str) -> str:
    """The SHA-256 digest (hex) of `token`: what a service checks presented tokens against."""
    return hashlib.sha256(token.encode()).hexdigest()


def verifier_of(token: str) -> str:
    """The verifier of `token`: what a service may hold instead of the token itself."""
    return VERIFIER_PREFIX + token_digest(token)


def control_verifier(state_dir: Path | str, environ: Mapping[str, str] | None = None) -> str | None:
    """What a service checks control calls against: the digest `servemesh up` gave it
    (`SERVEMESH_CONTROL_SHA256`), else that of the token in `state_dir` (a service started on
    its own, by the mesh's user); None (refuse every control call) when there is neither."""
    digest = (os.environ if environ is None else environ).get(CONTROL_VERIFIER_ENV, "").strip()
    if digest:
        return VERIFIER_PREFIX + digest
    token = read_control_token(state_dir)
    return verifier_of(token) if token is not None else None
