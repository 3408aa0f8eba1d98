"""`servemesh bench predict --client h2load` against the package's real mesh: h2load drives
the edge over TLS, and the window's outcomes are read from the edge Envoy's access log,
which sees the gRPC status that h2load cannot. Short windows at low concurrency: this
checks what is counted, not how fast the mesh is."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from servemesh.bench.h2load import Measured, frame_file, measure_edge, predict_body, send_marker
from servemesh.bench.observe import cpu_by_kind
from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.proxy.admin import AdminClient

pytestmark = pytest.mark.skipif(
    shutil.which("h2load") is None,
    reason="h2load is not installed (apt-get install nghttp2-client; .ci/run installs it)",
)
CONCURRENCY = 4


def _measure_edge(mesh: Mesh, body: bytes, tmp_path: Path) -> Measured:
    return measure_edge(
        mesh.spec.edge_address,
        frame_file(tmp_path, "predict", body),
        CONCURRENCY,
        0.6,
        0.2,
        5.0,
        tls=mesh.spec.tls.edge,
        access_log=mesh.logs_dir / "envoy-edge-access.log",
        read_cpu=lambda: cpu_by_kind(mesh),
        marker=lambda: send_marker(dial_edge(mesh.spec), "fraud", "user-1"),
        flush=lambda: AdminClient.of_mesh(mesh.state_dir).post("/reopen_logs"),
    )


def test_h2load_s_predicts_through_the_tls_edge_are_counted_from_the_access_log(
    mesh: Mesh, tmp_path: Path
) -> None:
    assert mesh.spec.tls.edge  # the edge h2load reaches is the TLS one
    measured = _measure_edge(mesh, predict_body("fraud", "user-1"), tmp_path)
    assert measured.ok > 10 and measured.errors == {}
    assert measured.cancelled_at_stop <= CONCURRENCY
    # Envoy's count of the window and h2load's own differ only at the window's edges: at
    # each, the calls started between h2load's own edge and the moment its line was read
    # (the window's clock), a handful per stream, more on a busy box; never a tenth more.
    edges = max(2 * CONCURRENCY, len(measured.latencies_ms) // 10)
    assert abs(measured.ok - len(measured.latencies_ms)) <= edges
    # The window as h2load ran it: at most what was asked, plus the time to read a line.
    assert 0 < measured.seconds < 0.6 + 0.25
    # The mesh's processes worked for those answers (the client's CPU is kept apart).
    assert measured.cpu_seconds["gateway"] > 0 and measured.cpu_seconds["model"] > 0
    assert "client" not in measured.cpu_seconds


def test_failures_h2load_reads_as_http_200_are_errors_by_grpc_status(
    mesh: Mesh, tmp_path: Path
) -> None:
    # An unknown model: every call ends with a gRPC error inside an HTTP 200 answer.
    measured = _measure_edge(mesh, predict_body("no-such-model", "user-1"), tmp_path)
    assert len(measured.latencies_ms) > 10  # h2load itself saw them all succeed
    assert measured.ok == 0
    assert sum(measured.errors.values()) >= len(measured.latencies_ms) - CONCURRENCY
    assert set(measured.errors) <= {"NOT_FOUND", "INVALID_ARGUMENT"}
