"""Edge credentials: a random key per mesh, kept in a 0600 file; Envoy sees only its hash.
And what the mesh's own callers of the edge (load, benchmarks, stream consumers) send there
in whatever auth mode the spec sets (`EdgeAuthMetadata`)."""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

from servemesh.contract.private import check_secret

if TYPE_CHECKING:
    from servemesh.spec import MeshSpec

CREDENTIALS_FILE = "edge-credentials"
DEFAULT_USER = "servemesh"


def credentials_path(state_dir: Path) -> Path:
    return Path(state_dir) / CREDENTIALS_FILE


def ensure_edge_credentials(state_dir: Path) -> tuple[str, str]:
    """The mesh's (user, key), created on first use with owner-only permissions."""
    path = credentials_path(state_dir)
    existing = read_edge_credentials(state_dir)
    if existing is not None:
        return existing
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    # O_EXCL + 0600 at creation: the key is never readable by others, even for a moment.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(f"{DEFAULT_USER}:{key}\n")
    return DEFAULT_USER, key


def read_edge_credentials(state_dir: Path) -> tuple[str, str] | None:
    """The (user, key) kept in `state_dir`, None when none; PrivacyError when another user
    owns the file or others may read it."""
    path = credentials_path(state_dir)
    check_secret(path)
    try:
        line = path.read_text().strip()
    except FileNotFoundError:
        return None
    user, _, key = line.partition(":")
    return (user, key) if user and key else None


def htpasswd_line(user: str, key: str) -> str:
    """The line Envoy's basic_auth filter checks ({SHA} = base64 of the SHA-1 digest)."""
    digest = base64.b64encode(hashlib.sha1(key.encode()).digest()).decode()  # noqa: S324 (Envoy's format)
    return f"{user}:{{SHA}}{digest}"


def authorization_value(user: str, key: str) -> str:
    """The `authorization` header a caller sends through the edge."""
    return "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()


# A token one of the mesh's own callers signs for itself (jwt edge auth) lives this long,
# or the spec's max_token_ttl when that is shorter, and is renewed a fifth of it early.
SELF_TOKEN_TTL_S = 300.0


class EdgeAuthMetadata:
    """The credentials a caller of the mesh's own sends at the edge, as `servemesh predict`
    does: a token it signs for itself with the mesh's key (jwt, the spec's first role), the
    mesh's basic credentials (basic), nothing (off). Reads the key or the credentials file
    of the spec's state dir, so only a caller that may read them can use it."""

    def __init__(self, spec: MeshSpec, subject: str) -> None:
        self.spec = spec
        self.subject = subject
        self._token: tuple[float, list[tuple[str, str]]] | None = None

    @property
    def mode(self) -> str:
        return self.spec.traffic.edge_auth.active_mode

    def token_ttl_s(self) -> float:
        from servemesh.spec.durations import duration_seconds

        return min(SELF_TOKEN_TTL_S, duration_seconds(self.spec.traffic.edge_auth.max_token_ttl))

    def metadata(self) -> list[tuple[str, str]]:
        """The headers to send now (a fresh list: callers may add to it)."""
        from servemesh.contract.wire import AUTHORIZATION_HEADER

        if self.mode == "jwt":
            now = time.monotonic()
            if self._token is None or self._token[0] < now:
                ttl_s = self.token_ttl_s()
                header = [(AUTHORIZATION_HEADER, f"Bearer {self.sign(ttl_s)}")]
                self._token = (now + ttl_s * 0.8, header)
            return list(self._token[1])
        if self.mode == "basic":
            credentials = read_edge_credentials(Path(self.spec.state_dir))
            if credentials is not None:
                return [(AUTHORIZATION_HEADER, authorization_value(*credentials))]
        return []

    def sign(self, ttl_s: float) -> str:
        """A token of this caller's, valid `ttl_s` seconds (jwt mode)."""
        from servemesh.identity.tokens import mint_token

        role = self.spec.traffic.edge_auth.roles[0]
        return mint_token(self.spec, role, self.subject, ttl_s)
