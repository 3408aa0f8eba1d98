"""The consumer as a process: `servemesh stream consume --name S`, and what `servemesh up`
starts for each entry of the spec's `streams` (python -m servemesh.streams).

SIGTERM (or SIGINT) ends it after the batch in flight. Its /metrics listen on a free
loopback port, named in the stream's stats hash (`servemesh stream status`) and, while it
runs, in `<state_dir>/streams/<name>-<consumer>.targets.json` (a Prometheus file-discovery
target: the mesh's Prometheus scrapes it from there). Once its group exists it writes
`<state_dir>/streams/<name>.ready` (removed on the way out), which is what the launcher
waits for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from pathlib import Path

from servemesh.contract.atomic import atomic_write_text
from servemesh.spec import STREAM_TARGETS_GLOB, ResolvedSpec, StreamSpec, load_resolved
from servemesh.streams.consumer import Consumer, stream_client
from servemesh.streams.metrics import StreamMetrics
from servemesh.streams.predict import (
    FeatureWriter,
    InProcessPredictor,
    MeshPredictor,
    Predictor,
    feature_store_client,
)

log = logging.getLogger(__name__)


def ready_path(state_dir: str | Path, name: str) -> Path:
    return Path(state_dir) / "streams" / f"{name}.ready"


def targets_path(state_dir: str | Path, name: str, consumer: str) -> Path:
    """Where a running consumer names its /metrics for Prometheus (STREAM_TARGETS_GLOB)."""
    found = Path(state_dir) / STREAM_TARGETS_GLOB.replace("*", f"{name}-{consumer}")
    return found


def write_targets(path: Path, address: str, stream: str, consumer: str) -> None:
    """The consumer's /metrics as one file-discovery target (written whole, by rename:
    Prometheus never reads half a file)."""
    labels = {"service": "stream", "instance": consumer, "stream": stream}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps([{"targets": [address], "labels": labels}]) + "\n")


async def build_predictor(
    spec: ResolvedSpec, stream: StreamSpec, *, edge: str | None = None
) -> Predictor:
    if stream.mode == "in_process":
        from servemesh.services.feature.store import RedisFeatureStore

        store = RedisFeatureStore(feature_store_client(spec), spec.feature_store.key_prefix)
        return await InProcessPredictor.from_registry(spec, stream, store)
    return MeshPredictor(spec, stream, address=edge)


async def consume(
    spec: ResolvedSpec,
    name: str,
    *,
    consumer: str | None = None,
    edge: str | None = None,
    stop: asyncio.Event | None = None,
    metrics_port: int | None = 0,
) -> None:
    """Run the consumer of stream `name` until SIGTERM/SIGINT (or `stop`)."""
    stream = spec.stream(name)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    metrics = StreamMetrics(stream.name)
    address = ""
    if metrics_port is not None:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(metrics_port, spec.host, registry=metrics.registry)
        address = f"{spec.host}:{server.server_port}"
    client = stream_client(spec, stream)
    features = feature_store_client(spec)
    from servemesh.services.feature.store import RedisFeatureStore

    writer = FeatureWriter(
        RedisFeatureStore(features, spec.feature_store.key_prefix), spec, stream.model
    )
    predictor = await build_predictor(spec, stream, edge=edge)
    ready = ready_path(spec.state_dir, stream.name)
    targets: Path | None = None
    try:
        worker = Consumer(
            client,
            spec,
            stream,
            predictor,
            writer=writer,
            consumer=consumer,
            metrics=metrics,
            metrics_address=address,
        )
        await worker.ensure_group()
        if address:
            targets = targets_path(spec.state_dir, stream.name, worker.name)
            write_targets(targets, address, stream.name, worker.name)
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.write_text(f"{worker.name}\n")
        log.info("consuming", extra={"stream": stream.name, "consumer": worker.name})
        await worker.run(stop)
    finally:
        ready.unlink(missing_ok=True)
        if targets is not None:
            targets.unlink(missing_ok=True)
        await predictor.close()
        await features.aclose()
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m servemesh.streams")
    parser.add_argument("--spec", required=True, help="the running mesh's resolved spec")
    parser.add_argument("--name", required=True, help="the stream (streams[].name)")
    parser.add_argument("--consumer", help="this consumer's name in the group")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    spec = load_resolved(args.spec)
    asyncio.run(consume(spec, args.name, consumer=args.consumer))
    return 0
