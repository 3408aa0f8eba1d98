"""`servemesh cache flush MODEL`: drop every gateway's cached answers of a model.

The flush raises the model's flush generation in the mesh's Redis
(servemesh/contract/tier_keys.py); every gateway reads it with each tier lookup of the model and
drops its cached answers of the model when it changed, so the first call after the command
returned is answered by the model (or its precomputed tier) again. Precomputed answers are
a batch run's output: a new run replaces them.
"""

from __future__ import annotations

import argparse
import asyncio

from servemesh.cli.mesh import add_mesh_flags, running_mesh
from servemesh.cli.output import out
from servemesh.contract.errors import ServemeshError
from servemesh.contract.tier_keys import flush_key
from servemesh.state.running import RunningMesh


class NotCached(ServemeshError):
    """The model has no cache tier in the running spec."""


async def flush(mesh: RunningMesh, model: str) -> int:
    """Raise `model`'s flush generation; the new generation."""
    from servemesh.spec.store_clients import store_writer

    spec = mesh.spec
    client = store_writer(spec, socket_connect_timeout=2.0)
    try:
        return int(await client.incr(flush_key(spec.feature_store.key_prefix, model)))
    finally:
        await client.aclose()


def cmd_flush(args: argparse.Namespace) -> int:
    mesh = running_mesh(args)
    model = mesh.spec.models.get(args.model)
    if model is None:
        raise NotCached(f"model {args.model!r} is not served by this mesh")
    if model.tiers is None or model.tiers.cache is None:
        raise NotCached(f"model {args.model!r} has no cache tier (tiers.cache in the spec)")
    generation = asyncio.run(flush(mesh, args.model))
    out.print(
        f"flushed the cached answers of {args.model} (flush generation {generation}); "
        "every gateway drops them on its next call of the model",
        markup=False,
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cache = sub.add_parser("cache", help="the gateways' cached answers (a model's tiers.cache)")
    add_mesh_flags(cache)
    verbs = cache.add_subparsers(dest="verb", required=True)
    f = verbs.add_parser(
        "flush",
        help="drop every gateway's cached answers of a model",
        description="Raises the model's flush generation in the mesh's Redis; each gateway "
        "drops its cached answers of the model on its next call of it.",
    )
    f.add_argument("model", help="the model (a model of the running spec with tiers.cache)")
    f.set_defaults(func=cmd_flush, error_label="not flushed")
