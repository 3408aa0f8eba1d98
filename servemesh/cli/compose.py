"""`servemesh control-plane` and `servemesh compose init|probe|seed|consul-acl`
(docs/multihost.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.catalog.consul_acl import apply_plan
from servemesh.catalog.consul_catalog import consul_client
from servemesh.cli.output import write
from servemesh.contract.errors import ServemeshError, UsageError
from servemesh.contract.wire import message_size_options
from servemesh.discovery.compose import render_compose
from servemesh.discovery.control_plane import add_arguments, run_from_args
from servemesh.identity import OPERATOR_IDENTITY, dial_address, dial_registry
from servemesh.seeding import seed_demo
from servemesh.spec import load_resolved

DEFAULT_COMPOSE_SPEC = Path("deploy/compose/mesh.yaml")
DEFAULT_COMPOSE_OUT = Path("deploy/compose/rendered")
PROBE_TIMEOUT_S = 3.0


def cmd_compose_init(args: argparse.Namespace) -> int:
    rendered = render_compose(Path(args.spec), Path(args.out))
    instances = len(rendered.spec.instances())
    write(f"rendered {instances} instances' configs, certificates and secrets into {args.out}")
    write(f"next: {next_step(rendered.spec.discovery.backend, args.out)}")
    return 0


def next_step(backend: str, out: str) -> str:
    """The command that starts what was rendered: the DNS file runs on the images `make
    images` builds, with no Consul; the Consul file builds its own."""
    if backend == "dns":
        return (
            f"docker compose --env-file {out}/compose.env -f deploy/compose/dns.yml up -d "
            "(or make compose-up)"
        )
    return f"docker compose --env-file {out}/compose.env up --build"


async def _probe(spec_path: str, instance: str) -> bool:
    spec = load_resolved(spec_path)
    # The container's own process, at its own port on its loopback: its service name may
    # resolve to another replica (a Swarm service of several tasks answers by any of
    # them). The instance's own certificate: the only one its container holds.
    own = f"127.0.0.1:{spec.serving_port_of(instance)}"
    async with dial_address(spec, own, instance, caller=instance).aio_channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            write(f"{instance}: {exc.code().name}: {exc.details()}", err=True)
            return False
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    write(f"{instance}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return bool(serving)


def instance_of_pid1(cmdline: Path = Path("/proc/1/cmdline")) -> str | None:
    """The --instance a container's first process was started with (the image's health
    check names no instance: the container's command does)."""
    try:
        argv = cmdline.read_bytes().split(b"\0")
    except OSError:
        return None
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == b"--instance":
            return value.decode()
    return None


def cmd_compose_probe(args: argparse.Namespace) -> int:
    instance = args.instance or instance_of_pid1()
    if instance is None:
        raise UsageError("no --instance given, and the container's command names none")
    return 0 if asyncio.run(_probe(args.spec, instance)) else 1


async def _seed(spec_path: str) -> None:
    spec = load_resolved(spec_path)
    options = message_size_options(spec.limits.max_message_bytes)
    dial = dial_registry(spec, caller=OPERATOR_IDENTITY)
    async with dial.aio_channel(options=options) as channel:
        await seed_demo(spec, channel)


def cmd_compose_seed(args: argparse.Namespace) -> int:
    asyncio.run(_seed(args.spec))
    write("seeded the demo models and features")
    return 0


def cmd_compose_consul_acl(args: argparse.Namespace) -> int:
    """Apply the rendered ACL plan, with the management token the spec's token file holds
    in this (one-shot) container."""
    try:
        spec = load_resolved(args.spec)
        plan = json.loads(Path(args.plan).read_text())
        apply_plan(consul_client(spec), plan)
    except (OSError, ValueError) as exc:  # the plan file (a SpecError is a ValueError)
        raise ServemeshError(str(exc)) from None
    write(f"consul ACLs: {len(plan['policies'])} policies and {len(plan['tokens'])} tokens")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    plane = sub.add_parser(
        "control-plane",
        help="watch the service catalog (Consul, or the spec) and write Envoy's endpoint files",
    )
    add_arguments(plane)
    plane.set_defaults(func=run_from_args)

    compose = sub.add_parser("compose", help="the docker-compose topology (docs/multihost.md)")
    verbs = compose.add_subparsers(dest="verb", required=True)
    init = verbs.add_parser(
        "init", help="render what docker-compose.yml mounts: configs, certificates, secrets"
    )
    init.add_argument("--spec", default=str(DEFAULT_COMPOSE_SPEC))
    init.add_argument("--out", default=str(DEFAULT_COMPOSE_OUT))
    init.set_defaults(func=cmd_compose_init)
    probe = verbs.add_parser("probe", help="a container's health check: is INSTANCE SERVING")
    probe.add_argument("--spec", required=True, help="resolved mesh spec")
    probe.add_argument("--instance", help="default: the container command's --instance")
    probe.set_defaults(func=cmd_compose_probe)
    seed = verbs.add_parser("seed", help="push the demo models and features (once, at start)")
    seed.add_argument("--spec", required=True, help="resolved mesh spec")
    seed.set_defaults(func=cmd_compose_seed)
    acl = verbs.add_parser(
        "consul-acl",
        help="make Consul's policies and every client's token (once, at start)",
    )
    acl.add_argument("--spec", required=True, help="resolved mesh spec")
    acl.add_argument("--plan", required=True, help="the rendered consul-acl-plan.json")
    acl.set_defaults(func=cmd_compose_consul_acl, error_label="compose consul-acl")
