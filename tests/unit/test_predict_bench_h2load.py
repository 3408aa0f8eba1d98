"""`servemesh bench predict --client h2load` without a mesh: how the edge's access log
gives a window's outcomes, how h2load's resets at its stop are kept apart, what the run
refuses before it starts anything, and a window turned into a round."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servemesh.bench.h2load import (
    PREDICT_METHOD,
    CpuWindow,
    Measured,
    outcome,
    predict_body,
    read_lines,
    rpc_outcomes,
    split_cancelled,
    window_outcomes,
)
from servemesh.bench.model import h2load
from servemesh.bench.predict import (
    EDGE,
    bench_predict,
    check_connections,
    check_h2load_fits,
    h2load_round,
    without_tiers,
)
from servemesh.cli import build_parser
from servemesh.contract.errors import UsageError
from servemesh.spec import MeshSpec, ModelVersionSpec, TiersSpec
from servemesh_api.gateway.v1 import gateway_pb2

# 2026-12-04T22:30:00Z in µs since the epoch.
T0 = 1_796_423_400_000_000


def _line(start: str, status: object, flags: str = "-", path: str = PREDICT_METHOD) -> str:
    return json.dumps({"start": start, "path": path, "grpc_status": status, "flags": flags})


def test_an_access_log_line_s_outcome_is_its_grpc_status_by_name() -> None:
    assert outcome({"grpc_status": 0}) == "OK"
    assert outcome({"grpc_status": "8"}) == "RESOURCE_EXHAUSTED"
    assert outcome({"grpc_status": 4}) == "DEADLINE_EXCEEDED"
    # A stream the client reset: flag DC, with no status or one Envoy inferred.
    assert outcome({"grpc_status": None, "flags": "DC"}) == "reset"
    assert outcome({"grpc_status": 2, "flags": "DC"}) == "reset"
    assert outcome({"grpc_status": "-", "flags": "UF"}) == "no grpc-status"
    assert outcome({"grpc_status": 99}) == "99"


def test_the_window_keeps_predicts_that_started_in_it(tmp_path: Path) -> None:
    log = tmp_path / "envoy-edge-access.log"
    log.write_text(
        "\n".join(
            [
                _line("2026-12-04T22:29:59.999Z", 0),  # before the window
                _line("2026-12-04T22:30:00.000Z", 0),
                _line("2026-12-04T22:30:00.500Z", 8),
                _line("2026-12-04T22:30:00.700Z", 0, path="/grpc.health.v1.Health/Check"),
                _line("2026-12-04T22:30:00.900Z", None, "DC"),
                _line("2026-12-04T22:30:01.000Z", 0),  # the window's end is open
            ]
        )
        + "\n"
        + '{"start": "2026-12-04T22:30:00.950Z", "pa'  # a line Envoy is still writing
    )
    lines = read_lines(log, 0)
    assert len(lines) == 6
    found = window_outcomes(lines, PREDICT_METHOD, T0, T0 + 1_000_000)
    assert found == {"OK": 1, "RESOURCE_EXHAUSTED": 1, "reset": 1}
    # From an offset: only what was written after it.
    offset = len(log.read_bytes().split(b"\n", 1)[0]) + 1
    assert len(read_lines(log, offset)) == 5
    assert read_lines(tmp_path / "none.log", 0) == []


def test_resets_at_the_stop_are_apart_up_to_one_a_stream() -> None:
    ok, errors, cancelled = split_cancelled({"OK": 900, "reset": 3, "UNAVAILABLE": 2}, 4, "OK")
    assert (ok, errors, cancelled) == (900, {"UNAVAILABLE": 2}, 3)
    # More resets than streams in flight: h2load's stop explains at most one per stream.
    ok, errors, cancelled = split_cancelled({"OK": 10, "reset": 5, "CANCELLED": 2}, 4, "OK")
    assert (ok, cancelled) == (10, 4)
    assert errors == {"cancelled beyond one per stream": 3}
    # The model server's counters name the outcomes in lower case.
    assert split_cancelled({"ok": 7, "cancelled": 1, "invalid": 0}, 2, "ok") == (7, {}, 1)


def test_a_bench_server_s_outcomes_are_its_calls_by_status() -> None:
    # ServerWindow's keys: the sample's name, then its labels but model and version.
    delta = {
        "servemesh_rpc_requests_total|code=OK|method=/inference.GRPCInferenceService/ModelInfer"
        "|service=model": 900.0,
        # Refused at the door, before any batch: counted here and nowhere in the batcher.
        "servemesh_rpc_requests_total|code=RESOURCE_EXHAUSTED"
        "|method=/inference.GRPCInferenceService/ModelInfer|service=model": 3.0,
        "servemesh_rpc_requests_total|code=OK|method=/grpc.health.v1.Health/Check"
        "|service=model": 5.0,
        "servemesh_rpc_requests_total|code=CANCELLED"
        "|method=/inference.GRPCInferenceService/ModelInfer|service=model": 0.0,
        "servemesh_model_requests_total|outcome=ok": 900.0,
    }
    assert rpc_outcomes(delta, "ModelInfer") == {"OK": 900, "RESOURCE_EXHAUSTED": 3}
    assert rpc_outcomes({}, "ModelInfer") == {}


def test_the_cpu_window_reads_cpu_by_kind_and_the_clock_at_its_edges() -> None:
    readings = iter([{"gateway": 1.0, "model": 2.0}, {"gateway": 1.5, "model": 2.25}])
    edges: list[bool] = []
    window = CpuWindow(lambda: next(readings), also=edges.append)
    window(True)
    window(False)
    assert window.spent == {"gateway": 0.5, "model": 0.25}
    assert edges == [True, False]
    assert window.closed_us >= window.opened_us > T0 - 10**15
    assert window.seconds == (window.closed_us - window.opened_us) / 1e6


def test_a_window_becomes_a_round_with_cpu_per_ok_answer() -> None:
    measured = Measured(
        ok=2000,
        seconds=2.0,
        latencies_ms=[float(v) for v in range(1, 101)],
        errors={"UNAVAILABLE": 3},
        cancelled_at_stop=5,
        cpu_seconds={"gateway": 1.0, "envoy": 0.5},
        client_cpu_seconds=0.1,
    )
    found = h2load_round(EDGE, 64, 1, measured)
    assert found.rps == 1000.0 and found.p50_ms == 50.0 and found.p99_ms == 99.0
    assert found.cpu_us == {"gateway": 500.0, "envoy": 250.0, "client": 50.0}
    assert found.errors == 3 and found.error_codes == {"UNAVAILABLE": 3}
    assert found.cancelled_at_stop == 5
    empty = h2load_round(EDGE, 1, 0, Measured(0, 2.0, [], {}, 0, {"gateway": 1.0}, 0.0))
    assert empty.rps == 0.0 and empty.cpu_us == {}


def test_the_edge_s_request_is_one_predict_for_one_entity() -> None:
    request = gateway_pb2.PredictRequest.FromString(predict_body("fraud", "user-0"))
    assert request.model == "fraud" and list(request.entity_ids) == ["user-0"]
    assert h2load.grpc_frame(b"ab")[:5] == b"\x00\x00\x00\x00\x02"


@pytest.fixture
def have_h2load(monkeypatch: pytest.MonkeyPatch) -> None:
    """check_h2load_fits looks for h2load first; these refusals come after that."""
    monkeypatch.setattr(h2load, "h2load_path", lambda: "/usr/bin/h2load")


@pytest.mark.usefixtures("have_h2load")
def test_h2load_refuses_rows_that_need_a_client_certificate() -> None:
    spec = MeshSpec()
    with pytest.raises(UsageError, match="--direct and --tls-cost"):
        check_h2load_fits(spec, "demo", direct=True, tls_cost=False)
    with pytest.raises(UsageError, match="client certificate"):
        check_h2load_fits(spec, "demo", direct=False, tls_cost=True)
    check_h2load_fits(spec, "demo", direct=False, tls_cost=False)


@pytest.mark.usefixtures("have_h2load")
def test_h2load_refuses_a_model_the_standalone_server_does_not_host() -> None:
    spec = MeshSpec()
    fraud = spec.models["fraud"]
    # All traffic on v2 (demo:2): the standalone server hosts demo:1.
    moved = spec.model_copy(
        update={"models": {"fraud": fraud.model_copy(update={"traffic": {"v1": 0, "v2": 100}})}}
    )
    with pytest.raises(UsageError, match="demo:1.*v2: demo:2"):
        check_h2load_fits(moved, "demo", direct=False, tls_cost=False)
    renamed = spec.model_copy(update={"models": {"scorer": fraud}})
    with pytest.raises(UsageError, match="'scorer'"):
        check_h2load_fits(renamed, "demo", direct=False, tls_cost=False)
    own = fraud.model_copy(
        update={"versions": {"v1": ModelVersionSpec(source="registry"), "v2": fraud.versions["v2"]}}
    )
    with pytest.raises(UsageError, match="--client python"):
        check_h2load_fits(spec.model_copy(update={"models": {"fraud": own}}), "demo",
                          direct=False, tls_cost=False)  # fmt: skip


def test_h2load_s_one_entity_is_never_answered_from_a_tier() -> None:
    spec = MeshSpec()
    fraud = spec.models["fraud"]
    tiered = spec.model_copy(
        update={"models": {"fraud": fraud.model_copy(update={"tiers": TiersSpec()})}}
    )
    assert tiered.models["fraud"].tiers is not None
    assert without_tiers(tiered).models["fraud"].tiers is None


def test_bench_predict_takes_the_client_and_its_connections() -> None:
    args = build_parser().parse_args(["bench", "predict", "--client", "h2load"])
    assert args.client == "h2load" and args.connections == 1
    args = build_parser().parse_args(["bench", "predict", "--connections", "8"])
    assert args.client == "python" and args.connections == 8


def test_every_concurrency_shares_evenly_over_the_connections() -> None:
    check_connections([1, 64], 1)
    check_connections([8, 64], 8)
    with pytest.raises(UsageError, match="--connections 8: .*not 1"):
        check_connections([1, 64], 8)
    with pytest.raises(UsageError, match="not 12"):
        check_connections([12, 64], 8)
    with pytest.raises(UsageError, match="--connections 0"):
        check_connections([64], 0)
    # The edge holds so many streams on one connection; h2load would send fewer.
    check_connections([64], 1, max_streams=100)
    with pytest.raises(UsageError, match="128 streams on one connection.*holds 100"):
        check_connections([1, 128], 1, max_streams=100)
    check_connections([128], 2, max_streams=100)


def test_the_python_client_has_one_channel_and_no_connections_to_set() -> None:
    with pytest.raises(UsageError, match="one channel"):
        bench_predict(MeshSpec(), client="python", connections=8)
