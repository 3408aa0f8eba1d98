"""The command line every service process shares: --spec FILE --instance NAME."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from pathlib import Path

from servemesh.catalog.registration import join_catalog
from servemesh.services.runtime.faults import control_file
from servemesh.services.runtime.live_spec import LiveSpec
from servemesh.services.runtime.logs import configure_logging, set_request_logs
from servemesh.services.runtime.server import ServiceServer, run_service
from servemesh.services.runtime.tracing import configure_tracing
from servemesh.spec import Instance, ResolvedSpec, load_resolved

Builder = Callable[[ResolvedSpec, str], Awaitable[ServiceServer]]


def service_main(
    build: Builder,
    argv: list[str] | None = None,
    known: Callable[[ResolvedSpec, str], Instance] | None = None,
) -> None:
    """Run one service process of the mesh until it is drained. `known` finds the process
    by the name given (SpecError when the spec runs no such process): an instance of the
    spec's unless it says otherwise (a registry mirror, which is no instance)."""
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--spec", required=True, help="resolved mesh spec (written by servemesh up)"
    )
    parser.add_argument("--instance", required=True, help="instance name, e.g. gateway-zone-a-0")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--request-logs",
        action="store_true",
        help="also log a line per request answered, whatever the spec's logs.requests says",
    )
    args = parser.parse_args(argv)
    spec = load_resolved(args.spec)
    # Fail fast on an unknown name.
    found = known(spec, args.instance) if known is not None else spec.instance(args.instance)
    configure_logging(
        args.instance, args.log_level, request_logs=args.request_logs or spec.logs.requests
    )
    configure_tracing(spec, args.instance, found)

    async def build_and_watch() -> ServiceServer:
        # Stamped before the build (a model server loads for a while): a change written
        # meanwhile is one the first poll sees, not one the service never hears of.
        live = LiveSpec(Path(args.spec), spec)
        server = await build(spec, args.instance)
        server.watch_faults(control_file(Path(spec.state_dir), args.instance))

        async def follow_logs(new: ResolvedSpec) -> None:
            set_request_logs(args.request_logs or new.logs.requests)

        server.on_spec_change(follow_logs)
        # `servemesh apply` rewrites this file; the builder's hooks follow it.
        server.follow_spec(live)
        if spec.discovery.backend == "consul" and known is None:
            # Registered once it serves (Consul's first check then finds it listening);
            # deregistered by the drain, after the last call has ended. A process that
            # is no instance of the spec (a registry mirror) is dialled by address: no
            # cluster may list it.
            await server.start()
            leave = await join_catalog(spec, args.instance)
            if leave is not None:
                server.on_stop(leave)
        return server

    run_service(build_and_watch)
