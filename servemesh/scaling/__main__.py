"""`python -m servemesh.scaling --state-dir D`: the scaler, as `servemesh up` runs it (and
`servemesh scale run` in the foreground, against a mesh started elsewhere).

It writes `<state_dir>/scaling/ready` once it runs, and its /metrics address (a free
loopback port) in `<state_dir>/scaling/scaler.targets.json` for the mesh's Prometheus
(both removed on the way out); SIGTERM ends it between rounds, or cuts a step short (the
mesh keeps whatever the last confirmed change left: a replica started out of rotation
stays out of it until the next round).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType

from servemesh.scaling.history import FOLDER
from servemesh.spec import SCALER_TARGETS_FILE

READY = f"{FOLDER}/ready"


def ready_path(state_dir: str | Path) -> Path:
    return Path(state_dir) / READY


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servemesh.scaling")
    parser.add_argument("--state-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return run(Path(args.state_dir))


def run(state_dir: Path) -> int:
    from prometheus_client import start_http_server

    from servemesh.contract.atomic import atomic_write_text
    from servemesh.contract.private import private_dir
    from servemesh.proxy.admin import AdminClient
    from servemesh.proxy.apply import RouteManager
    from servemesh.scaling.loop import Scaler
    from servemesh.scaling.metrics import ScalerMetrics
    from servemesh.state.paths import MeshPaths

    stop = threading.Event()

    def on_term(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    manager = RouteManager(MeshPaths(state_dir), AdminClient.of_mesh(state_dir))
    ready = ready_path(state_dir)
    private_dir(ready.parent)
    metrics = ScalerMetrics()
    host = manager.live_spec().host
    server, thread = start_http_server(0, host, registry=metrics.registry)
    targets = state_dir / SCALER_TARGETS_FILE
    address = f"{host}:{server.server_port}"
    labels = {"service": "scaler", "instance": "scaler"}
    atomic_write_text(targets, json.dumps([{"targets": [address], "labels": labels}]) + "\n")
    ready.write_text(f"{os.getpid()}\n")
    try:
        Scaler(manager, metrics=metrics).run(stop)
    finally:
        ready.unlink(missing_ok=True)
        targets.unlink(missing_ok=True)
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    return 0


def metrics_address(state_dir: str | Path) -> str | None:
    """The running scaler's /metrics address (None: no scaler runs there)."""
    try:
        found = json.loads((Path(state_dir) / SCALER_TARGETS_FILE).read_text())
        return str(found[0]["targets"][0])
    except (OSError, ValueError, LookupError, TypeError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
