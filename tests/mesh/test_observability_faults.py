"""Observability never fails a prediction: killing the trace store, losing the prediction
log's database, or a log directory that cannot be written, under a steady open-loop load
through the edge, leaves every Predict answered OK; the losses are counted, and traces and
records flow again once the part is back."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from servemesh.cli import main
from servemesh.contract.wire import TRACE_HEADERS
from servemesh.identity import dial_edge
from servemesh.launcher import TRACE_STORE, Mesh
from servemesh.load import BackgroundLoad, Outcome, predict_target
from servemesh.predlog.buffer import STATUS_FILE, predictions_dir
from servemesh.spec import DemoSpec, MeshSpec, Ports, Replicas
from servemesh.tracestore.receiver import store_path
from servemesh.tracestore.store import TraceStore
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.postgres_server import PostgresServer
from tests.waiting import wait_until

pytestmark = pytest.mark.mesh

ENTITIES = 50
RATE_PER_S = 40.0
# Calls sent while the part is down before it comes back: a few seconds of load, so that
# several flushes and exports fail while requests keep coming.
CALLS_WHILE_DOWN = 120
GATEWAY = "gateway-zone-a-0"


def small_mesh_spec(state_dir: Path, **updates: Any) -> MeshSpec:
    """One zone, one replica of each service; every request traced, spans and records
    leaving every 100 ms (so a dead part is hit within a fraction of a second)."""
    one = Replicas(per_zone={"zone-a": 1})
    spec = MeshSpec(
        ports=Ports.free(),
        state_dir=str(state_dir),
        zones=["zone-a"],
        gateway=one,
        feature=one,
        model_servers=one,
        demo=DemoSpec(enabled=True, entities=ENTITIES),
    )
    return spec.model_copy(
        update={
            "metrics": spec.metrics.model_copy(update={"prometheus": "off"}),
            "tracing": spec.tracing.model_copy(
                update={"sample_ratio": 1.0, "export_interval_ms": 100}
            ),
            "prediction_log": spec.prediction_log.model_copy(
                update={"flush_interval_ms": 100.0, **updates}
            ),
        }
    )


@pytest.fixture(scope="module")
def parquet_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    spec = small_mesh_spec(tmp_path_factory.mktemp("observed-mesh"))
    with Mesh.from_spec(spec) as mesh:
        yield mesh


@pytest.fixture
def load(parquet_mesh: Mesh) -> Iterator[BackgroundLoad]:
    with steady_load(parquet_mesh) as running:
        yield running


@contextmanager
def steady_load(mesh: Mesh) -> Iterator[BackgroundLoad]:
    """An open loop through the edge, started once the first calls are answered."""
    running = BackgroundLoad(
        predict_target(dial_edge(mesh.spec), entities=ENTITIES, timeout_s=5.0),
        rate_per_s=RATE_PER_S,
    )
    running.start()
    try:
        wait_until(lambda: sum(o.ok for o in running.outcomes) >= 20, "the load's first answers")
        yield running
    finally:
        running.stop()


def _sent_after(load: BackgroundLoad, at_s: float) -> int:
    return sum(1 for o in list(load.outcomes) if o.sent_s >= at_s)


def _finish(load: BackgroundLoad, down_at_s: float) -> list[Outcome]:
    """Stop the load; every call it sent, in order of sending (all of them answered)."""
    load.stop()
    assert not load.error, load.error
    outcomes = load.snapshot()
    assert len(outcomes) == load.sent  # nothing left unanswered
    assert sum(1 for o in outcomes if o.sent_s >= down_at_s) >= CALLS_WHILE_DOWN
    return outcomes


def _failed(outcomes: list[Outcome]) -> list[tuple[float, str]]:
    return [(round(o.sent_s, 3), o.code) for o in outcomes if not o.ok]


def _status(mesh: Mesh) -> dict[str, Any] | None:
    """The gateway's prediction-log counters, from its status file (None while it cannot
    be read)."""
    try:
        data: dict[str, Any] = json.loads(
            (predictions_dir(mesh.state_dir) / GATEWAY / STATUS_FILE).read_text()
        )
    except (OSError, ValueError):
        return None
    return data


def _logged(mesh: Mesh, *needles: str) -> bool:
    """Whether the gateway's log holds a line with every one of `needles`."""
    text = (mesh.logs_dir / f"{GATEWAY}.log").read_text(errors="replace")
    return any(all(n in line for n in needles) for line in text.splitlines())


def _forced_trace_request(mesh: Mesh) -> str:
    """One Predict with a sampled traceparent; its request id."""
    traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    with dial_edge(mesh.spec).channel() as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Predict(
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1"]),
            timeout=10,
            metadata=[(TRACE_HEADERS[0], traceparent)],
        )
    return reply.request_id


def test_killing_the_trace_store_never_fails_a_predict(
    parquet_mesh: Mesh, load: BackgroundLoad
) -> None:
    mesh = parquet_mesh
    store = TraceStore(store_path(mesh.state_dir))
    try:
        # Spans of this load are arriving (every request is traced here).
        wait_until(lambda: store.slowest(1, 0), "spans of the load in the trace store")
    finally:
        store.close()

    mesh.kill(TRACE_STORE)
    down_at = load.now_s()
    # The gateway's exporter meets the dead store, and calls keep coming meanwhile.
    wait_until(
        lambda: _logged(mesh, "export", "traces", "UNAVAILABLE"),
        "the gateway's span export failing",
    )
    wait_until(lambda: _sent_after(load, down_at) >= CALLS_WHILE_DOWN, "calls with the store dead")

    mesh.restart(TRACE_STORE)
    outcomes = _finish(load, down_at)
    assert _failed(outcomes) == []

    # Traces flow again: a forced trace is found by its request id.
    request_id = _forced_trace_request(mesh)
    store = TraceStore(store_path(mesh.state_dir))
    try:
        wait_until(lambda: store.find(request_id), f"the trace of {request_id} after a restart")
    finally:
        store.close()


def _put_back(folder: Path, aside: Path) -> None:
    """The gateway's log directory back in place of the file that stood for it. The writer
    makes its directory again when it finds none, so between the file's removal and the
    rename it may have made a new one: its files join the old directory, then it goes."""
    folder.unlink()
    for _ in range(20):
        try:
            aside.rename(folder)
            return
        except OSError:
            try:
                for written in folder.iterdir():
                    written.rename(aside / written.name)
                folder.rmdir()
            except OSError:  # the writer is still at it: the next round moves the rest
                continue
    raise AssertionError(f"{folder} kept coming back while being put back")


def test_an_unwritable_log_directory_never_fails_a_predict(
    parquet_mesh: Mesh, load: BackgroundLoad, capsys: pytest.CaptureFixture[str]
) -> None:
    mesh = parquet_mesh
    folder = predictions_dir(mesh.state_dir) / GATEWAY
    before = wait_until(
        lambda: (s := _status(mesh)) and s["written"] >= 20 and s, "records written"
    )
    # A file where the gateway's directory was: no write there can succeed, whoever runs
    # the test (root ignores a directory's mode bits, so chmod alone would not do).
    aside = folder.with_name(folder.name + ".aside")
    folder.rename(aside)
    folder.write_text("not a directory\n")
    down_at = load.now_s()
    try:
        # The writer flushes every 2 s; a busy machine (two suites' workers) can hold it.
        wait_until(
            lambda: _logged(mesh, "prediction log: a batch could not be written"),
            "the log's writer failing",
            timeout_s=90,
        )
        wait_until(
            lambda: _sent_after(load, down_at) >= CALLS_WHILE_DOWN, "calls with the log broken"
        )
    finally:
        _put_back(folder, aside)

    # Written again, with the failed batches counted.
    after = wait_until(
        lambda: (
            (s := _status(mesh))
            and s["write_errors"] >= 1
            and s["written"] > before["written"]
            and s
        ),
        "records written again, failures counted",
    )
    outcomes = _finish(load, down_at)
    assert _failed(outcomes) == []
    assert after["dropped"] == 0  # the buffer never filled: failed batches are not retried

    capsys.readouterr()
    assert main(["log", "status", "--state-dir", str(mesh.state_dir), "--json"]) == 0
    shown = {g["gateway"]: g for g in json.loads(capsys.readouterr().out)["gateways"]}
    assert shown[GATEWAY]["write_errors"] >= 1


class TcpProxy:
    """A TCP proxy on loopback in a thread of its own, in front of `upstream`: `stop()`
    closes its port and cuts every connection through it (the database is gone, for
    whoever dials it here); `start()` opens the same port again."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    def start(self) -> None:
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._connections):
            writer.transport.abort()
        self._connections.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self._connections |= {writer, up_writer}
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            self._connections.discard(writer)
            writer.transport.abort()


def test_losing_the_log_database_never_fails_a_predict(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    table = f"predictions_faults_{uuid.uuid4().hex[:12]}"
    proxy = TcpProxy((postgres.host, postgres.port))
    proxy.start()
    dsn = f"host=127.0.0.1 port={proxy.port} dbname=test user=postgres"
    try:
        spec = small_mesh_spec(tmp_path, postgres_dsn=dsn, postgres_table=table)
        with Mesh.from_spec(spec) as mesh, steady_load(mesh) as load:
            before = wait_until(
                lambda: (s := _status(mesh)) and s["written"] >= 20 and s, "records written"
            )
            proxy.stop()
            down_at = load.now_s()
            failed = wait_until(
                lambda: (s := _status(mesh)) and s["write_errors"] >= 1 and s,
                "the log's writer failing",
            )
            wait_until(
                lambda: _sent_after(load, down_at) >= CALLS_WHILE_DOWN,
                "calls with the database gone",
            )
            proxy.start()  # the same port: the writer reconnects at its next batch
            wait_until(
                lambda: (s := _status(mesh)) and s["written"] > failed["written"] and s,
                "records written again",
            )
            outcomes = _finish(load, down_at)
            assert _failed(outcomes) == []
        # The mesh has stopped: the gateway flushed what it held and wrote its last counters.
        final = _status(mesh)
        assert final is not None and final["written"] > before["written"]
        assert final["dropped"] == 0 and final["write_errors"] >= 1
        # The table holds every batch the gateway counted as written, and none it did not
        # accept (a batch cut off mid-COPY is rolled back, not half kept).
        with psycopg.connect(postgres.dsn()) as conn:
            query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
            row = conn.execute(query).fetchone()
        assert row is not None and final["written"] <= row[0] <= final["accepted"]
    finally:
        proxy.close()
        with psycopg.connect(postgres.dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
