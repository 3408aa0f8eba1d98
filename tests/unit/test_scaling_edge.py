"""The scaler on what the caller sees: Predict at the edge (Envoy's statistics as its admin
API answers them), the hop a breach is blamed on, and the host's headroom, each from texts
a real Envoy and a real /proc give; then the round end to end with every replica's own
signal under its target."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from servemesh.observe.scrape import Sample
from servemesh.scaling.blame import Hop, blame, hop_shares
from servemesh.scaling.decide import PoolSignals, Stabilizer, decide
from servemesh.scaling.edge import PREDICT_STATS, PREDICT_TIME, EdgeReader, parse_stats
from servemesh.scaling.history import pool_status, read_history, read_status
from servemesh.scaling.host import HostReader, cpu_times, runnable
from servemesh.scaling.loop import Scaler
from servemesh.scaling.signals import RPC, RPC_SECONDS, SERVING_METHODS
from servemesh.spec import MeshSpec, Ports, resolve
from servemesh.spec.rollout_plan import RolloutSpec, SloSpec
from servemesh.spec.scaling_policy import PoolPolicy, ScalingSpec, front_targets
from servemesh.state.paths import MeshPaths
from tests.unit.test_scaling_loop import FakeActuator, FakeManager

# Envoy's histogram bounds (ms), as its admin API lists them.
BOUNDS = [0.5, 1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000]


def envoy_stats(counts: dict[float, int], codes: dict[int, int]) -> str:
    """What `/stats?format=json&histogram_buckets=cumulative` answers for Predict's stats:
    `counts` calls that took up to each bound (ms), `codes` calls by gRPC status."""
    running, buckets = 0, []
    for bound in BOUNDS:
        running += counts.get(bound, 0)
        buckets.append({"upper_bound": bound, "interval": 0, "cumulative": running})
    stats: list[dict[str, object]] = [
        {"name": f"{PREDICT_STATS}{code}", "value": n} for code, n in codes.items()
    ]
    stats.append({"name": f"{PREDICT_STATS}total", "value": sum(codes.values())})
    stats.append({"histograms": [{"name": PREDICT_TIME, "buckets": buckets}]})
    return json.dumps({"stats": stats})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_edge_reader_gives_the_interval_p99_and_the_sli_error_ratio() -> None:
    texts = [
        envoy_stats({5: 100}, {0: 100}),
        # 100 more calls: 90 within 10 ms, 10 over 250 ms; 4 UNAVAILABLE (14) and 2
        # INVALID_ARGUMENT (3), the caller's own error, not counted against the objective.
        envoy_stats({5: 100, 10: 90, 500: 10}, {0: 194, 14: 4, 3: 2}),
    ]
    clock = Clock()
    reader = EdgeReader(lambda path: texts.pop(0), clock)
    assert reader.read() is None  # the first reading has no interval
    clock.now += 2.0
    seen = reader.read()
    assert seen is not None
    assert seen.calls_per_s == 50.0
    assert seen.error_ratio == pytest.approx(0.04)
    # The 99th of 100 calls lies in (250, 500]: interpolated as histogram_quantile does.
    assert seen.p99_ms == pytest.approx(250 + 250 * (99 - 90) / 10)


def test_an_edge_that_restarted_gives_no_interval_rather_than_negative_calls() -> None:
    texts = [envoy_stats({5: 500}, {0: 500}), envoy_stats({5: 3}, {0: 3})]
    clock = Clock()
    reader = EdgeReader(lambda path: texts.pop(0), clock)
    reader.read()
    clock.now += 1
    assert reader.read() is None


def test_parse_stats_reads_only_predicts_own_statistics() -> None:
    text = json.dumps(
        {"stats": [{"name": "cluster.gateway.upstream_rq_total", "value": 9}, {"histograms": {}}]}
    )
    assert parse_stats(text) == ({}, {}, 0.0)


IDLE_STAT = "cpu  100 0 100 800 0 0 0 0 0 0\nprocs_running 1\n"


def proc_stat(busy: int, idle: int, running: int) -> str:
    return (
        f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\nprocs_running {running}\n"
    )


def test_the_host_is_saturated_only_when_busy_and_queued_beyond_its_cores() -> None:
    assert cpu_times(proc_stat(300, 700, 1)) == (300, 1000)
    assert runnable(proc_stat(0, 0, 5)) == 4  # the reading itself is one of them
    texts = [proc_stat(0, 0, 1), proc_stat(950, 50, 6), proc_stat(1900, 100, 2)]
    host = HostReader(lambda path: texts.pop(0), cores=2)
    assert host.read().busy is None
    busy_and_queued = host.read()
    assert busy_and_queued.busy == pytest.approx(0.95)
    assert busy_and_queued.saturated and busy_and_queued.headroom_cores == pytest.approx(0.1)
    assert "CPU 95% busy, run queue 5 on 2 cores" == busy_and_queued.describe()
    busy_no_queue = host.read()
    assert busy_no_queue.busy == pytest.approx(0.95) and not busy_no_queue.saturated


def hops(gateway: float, model: float, feature: float, room: bool = True) -> dict[str, Hop]:
    return {
        "gateway": Hop("gateway", "gateway", gateway, room),
        "model-fraud": Hop("model-fraud", "model", model, room),
        "feature": Hop("feature", "feature", feature, room),
    }


def test_the_hop_whose_share_grew_is_blamed_else_the_gateway_first() -> None:
    quiet = hop_shares(20.0, hops(18.0, 8.0, 4.0))
    assert quiet == pytest.approx({"gateway": 0.4, "model-fraud": 0.4, "feature": 0.2})
    # Overload: 590 ms at the edge while the model's own p99 stays at 20 ms.
    loud_hops = hops(40.0, 20.0, 5.0)
    loud = hop_shares(590.0, loud_hops)
    assert loud["gateway"] == pytest.approx(565 / 590)
    found = blame(loud, quiet, loud_hops)
    assert found is not None and found.label == "gateway"
    assert found.why == "gateway's share of the edge p99 0.96 (was 0.40)"
    # A slow model: its share grew.
    slow_hops = hops(300.0, 280.0, 5.0)
    found = blame(hop_shares(300.0, slow_hops), quiet, slow_hops)
    assert found is not None and found.label == "model-fraud"
    # No baseline yet: the gateway first; the gateway at its max: the model pool.
    found = blame(loud, None, loud_hops)
    assert found is not None and found.label == "gateway" and "gateway first" in found.why
    no_room = {**loud_hops, "gateway": Hop("gateway", "gateway", 40.0, False)}
    found = blame(loud, None, no_room)
    assert found is not None and found.label == "model-fraud"
    assert blame(loud, None, hops(1, 1, 1, room=False)) is None


def test_the_edges_demand_grows_a_pool_at_target_unless_cooling_at_max_or_starved() -> None:
    policy = PoolPolicy(up_window="10s", cooldown="30s", max=3, target=front_targets())
    at_target = PoolSignals(replicas=1, in_flight=2.0, cpu=0.1)
    now = datetime(2026, 12, 6, tzinfo=UTC)
    demand = (2, "edge p99 590 ms > 100 ms over 10s; gateway first")

    grown = decide("zone-a", policy, at_target, Stabilizer(), 100.0, now, demand=demand)
    assert (grown.desired, grown.signal, grown.reason) == (2, "edge", demand[1])

    cooling = Stabilizer(last_change_at=90.0)
    held = decide("zone-a", policy, at_target, cooling, 100.0, now, demand=demand)
    assert (held.desired, held.held, held.signal) == (1, "cooldown", "edge")

    full = PoolSignals(replicas=3, in_flight=2.0, cpu=0.1)
    held = decide("zone-a", policy, full, Stabilizer(), 100.0, now, demand=(4, demand[1]))
    assert (held.desired, held.held) == (3, "at max 3")

    starved = "CPU 97% busy, run queue 6 on 2 cores"
    held = decide("zone-a", policy, at_target, Stabilizer(), 100.0, now, demand=demand,
                  saturated=starved)  # fmt: skip
    assert held.desired == 1 and held.held == f"no headroom on this host: {starved}"
    assert held.line().endswith(f"stays 1 (no headroom on this host: {starved})")
    # The pool's own signals asking for more are held the same way.
    hot = PoolSignals(replicas=1, in_flight=200.0, cpu=0.1)
    held = decide("zone-a", policy, hot, Stabilizer(), 100.0, now, saturated=starved)
    assert held.desired == 1 and held.signal == "replicas" and "no headroom" in held.held
    # A floor still applies: the operator's minimum is not a signal.
    floored = PoolPolicy(min=2, max=3, target=front_targets())
    raised = decide("zone-a", floored, at_target, Stabilizer(), 100.0, now, saturated=starved)
    assert raised.desired == 2 and raised.signal == "bounds"


def _scaler(
    tmp_path: Path,
    edge_texts: list[str],
    host_texts: list[str],
    clock: Clock,
    slos: dict[str, SloSpec] | None = None,
) -> tuple[Scaler, dict[str, FakeActuator]]:
    quick = PoolPolicy(up_window="10s", cooldown="0s", max=3, target=front_targets())
    models = PoolPolicy(up_window="10s", cooldown="0s", max=3)
    spec = resolve(
        MeshSpec(
            ports=Ports.free(),
            state_dir=str(tmp_path),
            zones=["zone-a"],
            scaling=ScalingSpec(gateway=quick, feature=quick, model_servers=models),
            rollout=RolloutSpec(slos=slos or {}),
        )
    )

    def scrape(address: str) -> list[Sample]:
        # Every replica well under every target: a few calls in flight, a fast p99.
        kind = next(
            i.service for i in spec.instances() if spec.metrics_address_of(i.name) == address
        )
        method = SERVING_METHODS.get(kind, "")
        seconds = {"gateway": 0.02, "model": 0.01, "feature": 0.002}.get(kind, 0.01)
        calls = clock.now * 10
        return [
            Sample(RPC, {"method": method, "code": "OK"}, calls),
            Sample(f"{RPC_SECONDS}_bucket", {"method": method, "le": str(seconds)}, calls),
            Sample(f"{RPC_SECONDS}_bucket", {"method": method, "le": "+Inf"}, calls),
        ]

    actuators = {label: FakeActuator() for label in ("model-fraud", "gateway", "feature")}

    def edge_fetch(socket: Path) -> Callable[[str], str]:
        return lambda path: edge_texts.pop(0)

    scaler = Scaler(
        FakeManager(spec, MeshPaths(tmp_path)),  # type: ignore[arg-type]
        scrape=scrape,
        clock=clock,
        wall=lambda: datetime(2026, 12, 6, tzinfo=UTC),
        actuators=actuators,  # type: ignore[arg-type]
        host=HostReader(lambda path: host_texts.pop(0), cores=2),
        edge_fetch=edge_fetch,
    )
    return scaler, actuators


def _rounds(scaler: Scaler, clock: Clock, times: int, step_s: float = 5.0) -> None:
    for _ in range(times):
        scaler.round()
        clock.now += step_s


def test_a_breach_at_the_edge_over_the_up_window_grows_the_gateways(tmp_path: Path) -> None:
    """Every replica under its targets; the edge's p99 at 500 ms against 100 ms for three
    rounds (10 s): the gateway pool grows, the decision names the edge, and nothing else
    moves."""
    calls = [0]

    def slow_edge() -> str:
        calls[0] += 100
        return envoy_stats({500: calls[0]}, {0: calls[0]})

    texts = [slow_edge() for _ in range(4)]
    clock = Clock()
    scaler, actuators = _scaler(tmp_path, texts, [IDLE_STAT] * 4, clock)
    _rounds(scaler, clock, 4)
    assert actuators["gateway"].grown == [("zone-a", 2)]
    assert actuators["model-fraud"].grown == actuators["feature"].grown == []
    [entry] = read_history(tmp_path)
    assert entry["signal"] == "edge" and entry["pool"] == "gateway"
    assert entry["reason"].startswith("edge p99 498 ms > 100 ms over 10s")
    status = read_status(tmp_path)
    assert status is not None
    assert status["edges"]["zone-a"]["breach"].startswith("edge p99 498 ms")
    assert status["edges"]["zone-a"]["blamed"] == "gateway"
    assert pool_status(status, "gateway")["zone-a"]["signals"]["in_flight"] == 0.0


def test_a_stricter_slo_is_the_edges_objective(tmp_path: Path) -> None:
    calls = [0]

    def edge() -> str:
        calls[0] += 100
        return envoy_stats({50: calls[0]}, {0: calls[0]})

    clock = Clock()
    texts = [edge() for _ in range(4)]
    slos = {"fraud": SloSpec(p99_ms=20.0)}
    scaler, actuators = _scaler(tmp_path, texts, [IDLE_STAT] * 4, clock, slos)
    _rounds(scaler, clock, 4)
    assert actuators["gateway"].grown == [("zone-a", 2)]
    assert read_history(tmp_path)[0]["reason"].startswith("edge p99 50 ms > 20 ms")


def test_on_a_saturated_host_the_breach_is_named_not_answered_with_replicas(
    tmp_path: Path,
) -> None:
    calls = [0]

    def slow_edge() -> str:
        calls[0] += 100
        return envoy_stats({500: calls[0]}, {0: calls[0]})

    clock = Clock()
    host = [proc_stat(i * 990, i * 10, 7) for i in range(5)]
    scaler, actuators = _scaler(tmp_path, [slow_edge() for _ in range(5)], host, clock)
    _rounds(scaler, clock, 5)
    assert all(not a.grown for a in actuators.values())
    # Recorded once for the stretch, with the host's load in words.
    [entry] = read_history(tmp_path)
    assert entry["outcome"] == "held" and entry["signal"] == "edge"
    assert "no headroom on this host: CPU 99% busy, run queue 6 on 2 cores" in entry["line"]
    status = read_status(tmp_path)
    assert status is not None and status["host"]["saturated"] is True
    assert status["host"]["headroom_cores"] == pytest.approx(0.02)
    assert scaler.metrics.host_saturated._value.get() == 1


def test_intervals_between_envoys_histogram_merges_neither_end_nor_start_a_breach(
    tmp_path: Path,
) -> None:
    """Envoy merges histograms every 5 s: rounds of 1 s mostly see new calls counted but no
    new time. Those rounds keep the breach going; it still grows the pool once it lasted
    the up-window."""
    calls, timed = [0], [0]

    def edge(merged: bool) -> str:
        calls[0] += 20
        if merged:
            timed[0] = calls[0]
        return envoy_stats({500: timed[0]}, {0: calls[0]})

    texts = [edge(merged=i % 5 == 0) for i in range(16)]
    clock = Clock()
    scaler, actuators = _scaler(tmp_path, texts, [IDLE_STAT] * 16, clock)
    _rounds(scaler, clock, 16, step_s=1.0)
    assert actuators["gateway"].grown == [("zone-a", 2)]


def test_a_pool_is_not_shrunk_while_the_edge_is_above_its_scale_in_share(
    tmp_path: Path,
) -> None:
    """A pool at 2 whose own signals are idle shrinks after the down-window, except while
    its zone's edge p99 is above down_below (50%) of the objective: there it is kept."""
    policy = PoolPolicy(down_window="10s", cooldown="0s", max=3, target=front_targets())
    idle = PoolSignals(replicas=2, in_flight=0.0, cpu=0.01)
    now = datetime(2026, 12, 6, tzinfo=UTC)
    stabilizer = Stabilizer()
    kept = "edge p99 80 ms above 50% of 100 ms"
    for at in (100.0, 105.0, 110.0):
        found = decide("zone-a", policy, idle, stabilizer, at, now, keep=kept)
    assert (found.desired, found.held) == (2, kept)
    shrunk = decide("zone-a", policy, idle, stabilizer, 115.0, now)
    assert shrunk.desired == 1

    calls = [0]

    def edge(ms: float) -> str:
        calls[0] += 100
        return envoy_stats({ms: calls[0]}, {0: calls[0]})

    clock = Clock()
    scaler, _ = _scaler(tmp_path, [edge(100), edge(100)], [IDLE_STAT] * 2, clock)
    _rounds(scaler, clock, 2)
    assert scaler._kept_for_the_edge(scaler.manager.live_spec(), "zone-a", 0.5) == (
        "edge p99 100 ms above 50% of 100 ms"
    )
