"""Control calls need the mesh's control credential.

`wire.CONTROL_METHODS` (registry writes, model loads and unloads, feature writes) change
what the mesh serves. Every `ServiceServer` checks them (its call path calls
`ControlAuth.check` first thing in such a call): a call is answered only when it carries
`authorization: Bearer <token>` with the token of the mesh's state dir: UNAUTHENTICATED
without one, PERMISSION_DENIED with a wrong one, before the handler reads a single message.
Every other method passes untouched. The token and the header's value are never logged.

A service holds no token, only its SHA-256 digest (a verifier, `sha256:<hex>`, from
servemesh.contract.control_credential.control_verifier): it hashes the bearer a call presents and
compares digests. Given a token (tests, a server built in-process), it keeps only the
digest of it.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

import grpc

from servemesh.contract.control_credential import BEARER_PREFIX, VERIFIER_PREFIX, token_digest
from servemesh.contract.wire import AUTHORIZATION_HEADER, CONTROL_METHODS

log = logging.getLogger(__name__)

MISSING_MESSAGE = "control call: this method needs the mesh's control credential"
WRONG_MESSAGE = "control call: the control credential is not this mesh's"
UNSUPPORTED_MESSAGE = "control call: not supported"


def _presented(metadata: Any) -> str | None:
    """The bearer token a call carries, or None when it carries no bearer credential."""
    for key, value in metadata or ():
        if key == AUTHORIZATION_HEADER and isinstance(value, str):
            if value.startswith(BEARER_PREFIX):
                return value[len(BEARER_PREFIX) :].strip()
            return None
    return None


def is_control(method: str) -> bool:
    """Whether calls of `method` need the control credential."""
    return method in CONTROL_METHODS


class ControlAuth:
    """Refuses control calls that do not carry the mesh's control credential.

    `credential`: a verifier (`sha256:<hex>`, what a service is given) or the token itself,
    of which only the digest is kept. None (a service that found no credential) refuses
    every control call: a mesh without a credential accepts no changes rather than any.
    """

    def __init__(self, credential: str | None = None) -> None:
        self.digest: str | None = None
        self.token = credential

    @property
    def token(self) -> str | None:
        """The verifier checked against (`sha256:<hex>`), None when none: never a token."""
        return None if self.digest is None else VERIFIER_PREFIX + self.digest

    @token.setter
    def token(self, credential: str | None) -> None:
        if credential is None:
            self.digest = None
        elif credential.startswith(VERIFIER_PREFIX):
            self.digest = credential[len(VERIFIER_PREFIX) :].strip().lower()
        else:
            self.digest = token_digest(credential)

    def refusal(self, metadata: Any) -> tuple[grpc.StatusCode, str] | None:
        """The status a control call with `metadata` is refused with; None: let it in."""
        presented = _presented(metadata)
        if presented is None:
            return grpc.StatusCode.UNAUTHENTICATED, MISSING_MESSAGE
        expected = self.digest
        if expected is None or not hmac.compare_digest(
            token_digest(presented).encode(), expected.encode()
        ):
            return grpc.StatusCode.PERMISSION_DENIED, WRONG_MESSAGE
        return None

    async def check(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """Abort the control call of `context` unless it carries the credential."""
        refused = self.refusal(context.invocation_metadata())
        if refused is not None:
            code, message = refused
            # The method and the verdict only: never the header's value.
            log.warning("control call refused", extra={"method": method, "code": code.name})
            await context.abort(code, message)
