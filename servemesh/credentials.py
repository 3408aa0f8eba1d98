"""Edge credentials: a random key per mesh, kept in a 0600 file; Envoy sees only its hash."""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from pathlib import Path

from servemesh.private import check_secret

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
