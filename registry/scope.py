"""What a model server may read from the registry: the artifacts of its own pool's models.

A model server holds a mesh certificate so that it can fetch what it serves. A hostile model
in one pool runs in a process holding that certificate (docs/security.md, "What a hostile
model can still do"): were every model server's identity allowed every artifact, it could
fetch another pool's weights from here, which is what pools exist to prevent. So the
registry answers a model server's download only for the models its pool serves in the
running spec; other callers (the operator's tools, devices) are what they were.

The registry follows the resolved spec like every service; a server of a pool that an
`apply` just added may ask before the poll saw it, so an unknown model server makes the
registry read the spec file once more before it refuses.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from servemesh.identity.peers import peer_identity
from servemesh.registry.errors import PermissionDeniedError
from servemesh.spec import ResolvedSpec


@dataclass
class ModelServerScope:
    """Checks a call's peer against the running spec (`current`, `refresh` re-reads it)."""

    current: Callable[[], ResolvedSpec]
    refresh: Callable[[], Awaitable[bool]] | None = None

    async def check_download(self, context: grpc.aio.ServicerContext, model: str) -> None:
        """PermissionDeniedError unless the peer may download `model`'s artifacts: any peer
        but a model server, and a model server for its own pool's models."""
        spec = self.current()
        peer = peer_identity(context, spec.name)
        if not peer.startswith("model-"):
            return
        if self._serves(spec, peer, model):
            return
        if self.refresh is not None and await self.refresh():
            spec = self.current()
            if self._serves(spec, peer, model):
                return
        raise PermissionDeniedError(
            f"model {model[:128]!r}: {peer} is a model server of another pool; a model "
            "server reads only its own pool's models"
        )

    @staticmethod
    def _serves(spec: ResolvedSpec, peer: str, model: str) -> bool:
        pools = {i.pool for i in spec.instances() if i.name == peer and i.service == "model"}
        return model in spec.models and spec.pool_of(model) in pools
