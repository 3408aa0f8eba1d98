"""The control credential: a random token per mesh, kept in a 0600 file in the state dir.

Calls that change what the mesh serves (`wire.CONTROL_METHODS`) are answered only to a
caller that sends `authorization: Bearer <token>`; every service reads the token from the
state dir when it starts, and every legitimate caller (the CLI, `servemesh apply`, the
demo seeding, the drills) reads it from the same file. The token is never logged, printed
or put in an error message.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from servemesh.wire import AUTHORIZATION_HEADER

CONTROL_TOKEN_FILE = "control-token"
BEARER_PREFIX = "Bearer "

Metadata = tuple[tuple[str, str], ...]


class ControlCredentialMissing(FileNotFoundError):
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
    """The token kept in `state_dir`, or None when there is none (or it is empty)."""
    try:
        token = control_token_path(state_dir).read_text().strip()
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
