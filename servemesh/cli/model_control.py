"""`servemesh models load|unload MODEL VERSION`: an operator's model control on a pool.

Triton's explicit model control, for a pool: the version is loaded (or unloaded) on every
replica of the model's pool, each through OIP RepositoryModelLoad/Unload on its own port
(mutual TLS, dialled as `servemesh apply` dials it), each call carrying the mesh's control
credential (services/runtime/control_auth.py: without it a replica refuses the call).

A replica loads only a version its spec names (`servemesh apply` adds versions); in an
on-demand pool a load counts against the pool's memory budget like a call's load (the least
recently used idle version makes room), and an unloaded version is loaded again by its next
call. In an eager pool, unloading a version the spec routes traffic to turns its replicas
NOT_SERVING until it is loaded again (`models load`, or the next `servemesh apply`).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import grpc

from servemesh.cli.mesh import add_mesh_flags
from servemesh.cli.models import ModelsError, credential, running_mesh
from servemesh.cli.output import out
from servemesh.contract.control_credential import Metadata
from servemesh.contract.wire import LOAD_VERSION_PARAMETER, message_size_options
from servemesh.identity import dial_service
from servemesh.spec import ResolvedSpec
from servemesh.state.running import RunningMesh
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc

# A load downloads, verifies and warms a version up: seconds for the demo, minutes for a
# large model pulled over a slow link. Each replica gets this long.
LOAD_TIMEOUT_S = 300.0
UNLOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ReplicaOutcome:
    replica: str
    ms: float
    failure: str = ""  # "" when the replica did what was asked
    note: str = ""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def pool_replicas(spec: ResolvedSpec, model: str, pool: str | None) -> tuple[str, list[str]]:
    """The model's pool (checked against `pool` when given) and that pool's model servers."""
    if model not in spec.models:
        raise ModelsError(
            f"model {model[:128]!r} is not in the mesh's spec; add it and run `servemesh apply`"
        )
    served_by = spec.pool_of(model)
    if pool is not None and pool != served_by:
        raise ModelsError(f"model {model!r} is served by pool {served_by!r}, not by pool {pool!r}")
    replicas = [i.name for i in spec.instances() if i.service == "model" and i.pool == served_by]
    if not replicas:
        raise ModelsError(f"pool {served_by!r} has no model servers in the running spec")
    return served_by, replicas


def _version_parameter(version: str) -> dict[str, oip.ModelRepositoryParameter]:
    return {LOAD_VERSION_PARAMETER: oip.ModelRepositoryParameter(string_param=version)}


async def _control_one(
    spec: ResolvedSpec,
    replica: str,
    model: str,
    version: str,
    credential: Metadata,
    *,
    load: bool,
) -> ReplicaOutcome:
    started = time.perf_counter()
    options = message_size_options(spec.limits.max_message_bytes)
    async with dial_service(spec, replica).aio_channel(options=options) as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            if load:
                await stub.RepositoryModelLoad(
                    oip.RepositoryModelLoadRequest(
                        model_name=model, parameters=_version_parameter(version)
                    ),
                    timeout=LOAD_TIMEOUT_S,
                    metadata=credential,
                )
            else:
                await stub.RepositoryModelUnload(
                    oip.RepositoryModelUnloadRequest(
                        model_name=model, parameters=_version_parameter(version)
                    ),
                    timeout=UNLOAD_TIMEOUT_S,
                    metadata=credential,
                )
        except grpc.aio.AioRpcError as exc:
            ms = (time.perf_counter() - started) * 1000
            if not load and exc.code() == grpc.StatusCode.NOT_FOUND:
                # Nothing to unload there (never loaded, or evicted): what was asked holds.
                return ReplicaOutcome(replica, ms, note="was not loaded")
            return ReplicaOutcome(
                replica, ms, failure=_one_line(f"{exc.code().name}: {exc.details()}")
            )
    return ReplicaOutcome(replica, (time.perf_counter() - started) * 1000)


async def control(
    mesh: RunningMesh, model: str, version: str, pool: str | None, *, load: bool
) -> tuple[str, list[ReplicaOutcome]]:
    """Load or unload `model`/`version` on every replica of its pool, all at once."""
    served_by, replicas = pool_replicas(mesh.spec, model, pool)
    metadata = credential(mesh)
    outcomes = await asyncio.gather(
        *(
            _control_one(mesh.spec, replica, model, version, metadata, load=load)
            for replica in replicas
        )
    )
    return served_by, list(outcomes)


def _report(model: str, version: str, outcomes: list[ReplicaOutcome], verb: str) -> int:
    for outcome in outcomes:
        if outcome.failure:
            line = f"{outcome.replica}: refused: {outcome.failure}"
        else:
            note = f" ({outcome.note})" if outcome.note else ""
            line = f"{outcome.replica}: {verb} {model}/{version} in {outcome.ms:.0f} ms{note}"
        out.print(line, highlight=False, markup=False)
    failed = [o for o in outcomes if o.failure]
    if failed:
        others = f" (and {len(failed) - 1} more replicas)" if len(failed) > 1 else ""
        raise ModelsError(f"{failed[0].replica}: {failed[0].failure}{others}")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    mesh = running_mesh(args)
    _, outcomes = asyncio.run(control(mesh, args.model, args.version, args.pool, load=True))
    return _report(args.model, args.version, outcomes, "loaded")


def cmd_unload(args: argparse.Namespace) -> int:
    mesh = running_mesh(args)
    served_by, outcomes = asyncio.run(
        control(mesh, args.model, args.version, args.pool, load=False)
    )
    code = _report(args.model, args.version, outcomes, "unloaded")
    settings = mesh.spec.pools.get(served_by) if served_by else None
    routed = mesh.spec.models[args.model].traffic.get(args.version, 0) > 0
    if routed and (settings is None or not settings.on_demand):
        out.print(
            f"note: {args.model}/{args.version} takes traffic and its pool loads eagerly: its "
            "replicas are NOT_SERVING until `servemesh models load` (or the next apply) "
            "loads it again",
            highlight=False,
            markup=False,
        )
    return code


def register(verbs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`models load` and `models unload`, under `servemesh models`."""
    load = verbs.add_parser(
        "load",
        help="load a version on every replica of its pool (operator: the control credential)",
    )
    add_mesh_flags(load, inherited=True)
    load.add_argument("model")
    load.add_argument("version")
    load.add_argument(
        "--pool", help="the model's pool, checked against the spec (default: the spec's)"
    )
    load.set_defaults(func=cmd_load, error_label="models load")

    unload = verbs.add_parser(
        "unload",
        help="unload a version from every replica of its pool (on demand: its next call "
        "loads it again)",
    )
    add_mesh_flags(unload, inherited=True)
    unload.add_argument("model")
    unload.add_argument("version")
    unload.add_argument(
        "--pool", help="the model's pool, checked against the spec (default: the spec's)"
    )
    unload.set_defaults(func=cmd_unload, error_label="models unload")
