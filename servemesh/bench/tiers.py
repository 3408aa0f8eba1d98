"""`servemesh bench predict --tiers`: Predict with a model's tiers on against off, one mesh,
one run.

One mesh starts from the spec with `entities` demo entities. The top `precompute` entities of
a Zipf(`zipf_a`) mix are scored into Redis by a real `servemesh batch score --out redis` run
(the precomputed tier's answers); then, `repeats` times, the order turning each repeat:

- tiers off (a live `servemesh apply` of the model without `tiers`): c=`concurrency`
  Predicts of the Zipf mix (run once unmeasured first, then measured), then c=1 Predicts
  of one entity outside the precomputed set (online every call);
- tiers on (applied live: `precomputed: {from: redis}` and a cache, whose `freshness` is
  the run's): the same Zipf load, unmeasured then measured,
  the hit ratio read from the gateways' tier counters; then c=1 of that entity (the cache
  answers after its first call) and of the hottest entity (precomputed).

Each row is the median of its repeats with min-max and spread; CPU per answer is read from
/proc for every process of the mesh, as `bench predict` does.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import grpc
import numpy as np
import yaml

from servemesh.bench.observe import bench_credentials, wait_answering
from servemesh.bench.predict import (
    CALL_TIMEOUT_S,
    Round,
    bench_spec,
    measure,
    rate_cells,
    summarize_rows,
)
from servemesh.bench.report import BenchReport, progress
from servemesh.identity import Dial, dial_every_edge
from servemesh.launcher import Mesh
from servemesh.load import Target
from servemesh.load.outcome import Reply, Request
from servemesh.load.stats import spread
from servemesh.observe.scrape import scrape, sum_by
from servemesh.proxy.admin import AdminClient
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.live_apply import LiveApply
from servemesh.spec import (
    CacheTierSpec,
    MeshSpec,
    PrecomputedTierSpec,
    TiersSpec,
    declared,
    load_spec,
)
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc

OFF, ON = "tiers off", "tiers on"
ONLINE_C1, CACHE_C1, PRECOMPUTED_C1 = "online c=1", "cache c=1", "precomputed c=1"
LOOKUPS = "servemesh_gateway_tier_lookups_total"
# The goals.
GOAL_RPS_RATIO = 2.0
GOAL_P50_RATIO = 0.5
SAMPLES = 1 << 18  # the Zipf sequence the load cycles through


def zipf_ranks(n: int, a: float, count: int, seed: int = 0) -> np.ndarray:
    """`count` draws of ranks 0..n-1, rank k with probability proportional to (k+1)^-a."""
    weights = np.arange(1, n + 1, dtype=np.float64) ** -a
    return np.random.default_rng(seed).choice(n, size=count, p=weights / weights.sum())


def entity_target(
    dial: Dial,
    model: str,
    ids: Sequence[str],
    credentials: Callable[[], Sequence[tuple[str, str]]] = tuple,
) -> Target:
    """Predict for one entity per call, call i naming ids[i % len(ids)] (requests built
    once: the cache tiers answer in well under a millisecond), with `credentials()`."""

    def build(channel: grpc.aio.Channel) -> Request:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        requests = [gateway_pb2.PredictRequest(model=model, entity_ids=[i]) for i in ids]

        async def predict(index: int) -> Reply:
            reply = await stub.Predict(
                requests[index % len(requests)],
                timeout=CALL_TIMEOUT_S,
                metadata=tuple(credentials()) or None,
            )
            return Reply(reply.model_version, reply.model_replica, reply.model_zone, reply.degraded)

        return predict

    return Target(dial.address, build, dial.options, dial.credentials)


def tiers_of(cache_entries: int, freshness: Literal["read", "feed"] = "read") -> TiersSpec:
    return TiersSpec(
        precomputed=PrecomputedTierSpec.model_validate({"from": "redis", "max_age": "26h"}),
        cache=CacheTierSpec(ttl="10m", max_entries=cache_entries, freshness=freshness),
    )


class TierSwitch:
    """Turns the model's tiers on and off with live applies; returns once every gateway
    took the change (each logs one line per spec it takes)."""

    def __init__(self, mesh: Mesh, model: str) -> None:
        self.mesh = mesh
        self.model = model
        self.applier = LiveApply(RouteManager(mesh.paths, AdminClient.of_mesh(mesh.state_dir)))
        self.gateways = [i.name for i in mesh.spec.instances() if i.service == "gateway"]

    def _taken(self) -> list[int]:
        counts = []
        for name in self.gateways:
            lines = (self.mesh.logs_dir / f"{name}.log").read_text().splitlines()
            taken = 0
            for line in lines:
                if "spec changed" in line and line.startswith("{"):
                    taken += json.loads(line).get("msg") == "spec changed"
            counts.append(taken)
        return counts

    def set(self, tiers: TiersSpec | None) -> None:
        live = declared(self.applier.manager.live_spec())
        entry = live.models[self.model].model_copy(update={"tiers": tiers})
        text = yaml.safe_dump({"models": {self.model: entry.model_dump(mode="json")}})
        before = self._taken()
        if not self.applier.apply(text, "bench-tiers.yaml").plan.changed:
            return
        deadline = time.monotonic() + 30
        while any(a <= b for a, b in zip(self._taken(), before, strict=True)):
            if time.monotonic() > deadline:
                raise TimeoutError("the gateways never took the tiers change")
            time.sleep(0.05)


def tier_counts(mesh: Mesh, model: str) -> dict[tuple[str, str], float]:
    """(tier, result) -> lookups so far, over every gateway."""
    totals: dict[tuple[str, str], float] = {}
    for instance in mesh.spec.instances():
        if instance.service != "gateway":
            continue
        samples = scrape(mesh.spec.metrics_address_of(instance.name))
        for (m, tier, result), value in sum_by(
            samples, LOOKUPS, ("model", "tier", "result")
        ).items():
            if m == model:
                totals[(tier, result)] = totals.get((tier, result), 0.0) + value
    return totals


def hit_ratio(
    before: Mapping[tuple[str, str], float], after: Mapping[tuple[str, str], float]
) -> dict[str, float]:
    """Shares of the calls between two counts: answered precomputed, from the cache, and
    either (each call looks the precomputed tier up once)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    calls = sum(v for (tier, _), v in delta.items() if tier == "precomputed")
    if not calls:
        return {"calls": 0.0, "precomputed": 0.0, "cache": 0.0, "hit": 0.0}
    pre = delta.get(("precomputed", "hit"), 0.0) / calls
    cache = delta.get(("cache", "hit"), 0.0) / calls
    return {
        "calls": calls,
        "precomputed": round(pre, 4),
        "cache": round(cache, 4),
        "hit": round(pre + cache, 4),
    }


def precompute(mesh: Mesh, model: str, versions: Sequence[str], ids: Sequence[str]) -> float:
    """Score `ids` with each version into Redis by a real batch run; seconds taken."""
    path = mesh.state_dir / "bench-precomputed.csv"
    entity = mesh.spec.entities_of(mesh.spec.models[model])[0]
    path.write_text(entity + "\n" + "\n".join(ids) + "\n")
    started = time.perf_counter()
    for version in versions:
        done = subprocess.run(
            [sys.executable, "-m", "servemesh", "batch", "--state-dir", str(mesh.state_dir),
             "score", "--model", model, "--version", version, "--out", "redis",
             "--entities", str(path), "--progress", "off"],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"batch score of {model} {version} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - started


def bench_tiers(
    spec: MeshSpec,
    *,
    entities: int = 100_000,
    precomputed: int = 1000,
    zipf_a: float = 1.1,
    concurrency: int = 64,
    seconds: float = 6.0,
    repeats: int = 3,
    freshness: Literal["read", "feed"] = "read",
    progress: Callable[[Round], None] = lambda _: None,
) -> dict[str, object]:
    spec = bench_spec(spec)
    spec = spec.model_copy(update={"demo": spec.demo.model_copy(update={"entities": entities})})
    model = next(iter(sorted(spec.models)))
    live_versions = [v for v, w in spec.models[model].traffic.items() if w > 0]
    ranks = zipf_ranks(entities, zipf_a, SAMPLES)
    mix = [f"user-{k}" for k in ranks]
    hot = [f"user-{k}" for k in range(min(precomputed, entities))]
    # An entity past the precomputed set, called often enough to stay in any cache.
    warm = f"user-{min(precomputed, entities - 1)}"
    with tempfile.TemporaryDirectory() as state:
        mesh = Mesh.from_spec(spec, Path(state))
        started = time.perf_counter()
        mesh.start()
        startup_s = time.perf_counter() - started
        rounds: list[Round] = []
        ratios: list[dict[str, float]] = []
        try:
            wait_answering(mesh)
            scored_s = precompute(mesh, model, live_versions, hot)
            edge = dial_every_edge(mesh.spec)
            credentials = bench_credentials(mesh.spec)
            targets = {
                "mix": entity_target(edge, model, mix, credentials),
                "warm": entity_target(edge, model, [warm], credentials),
                "hot": entity_target(edge, model, [hot[0]], credentials),
            }
            switch = TierSwitch(mesh, model)
            tiers = tiers_of(max(1, entities), freshness)

            def run(target: str, name: str, c: int, repeat: int) -> None:
                found = measure(mesh, targets[target], name, c, seconds, repeat)
                progress(found)
                rounds.append(found)

            for repeat in range(repeats):
                for phase in (OFF, ON) if repeat % 2 == 0 else (ON, OFF):
                    switch.set(tiers if phase == ON else None)
                    # Unmeasured, as long as a measured round: a switch starts the gateways'
                    # caches empty, and a tier is judged on what it holds in a steady state
                    # (both phases get the same warm-up).
                    measure(mesh, targets["mix"], phase, concurrency, seconds, repeat)
                    before = tier_counts(mesh, model)
                    run("mix", phase, concurrency, repeat)
                    if phase == ON:
                        ratios.append(hit_ratio(before, tier_counts(mesh, model)))
                        run("warm", CACHE_C1, 1, repeat)
                        run("hot", PRECOMPUTED_C1, 1, repeat)
                    else:
                        run("warm", ONLINE_C1, 1, repeat)
            switch.set(None)
        finally:
            mesh.stop()
    rows = summarize_rows(rounds, set())
    by = {r.target: r for r in rows}
    paired = _paired(rounds)
    p50_ratio = by[CACHE_C1].p50_ms_median / by[ONLINE_C1].p50_ms_median
    rps_ratio = statistics.median(paired)
    weights = np.arange(1, entities + 1, dtype=np.float64) ** -zipf_a
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": model,
        "entities": entities,
        "zipf_a": zipf_a,
        "precomputed_entities": len(hot),
        "precomputed_share_expected": round(float(weights[: len(hot)].sum() / weights.sum()), 4),
        "precompute_s": round(scored_s, 2),
        "startup_s": round(startup_s, 2),
        "concurrency": concurrency,
        "freshness": freshness,
        "seconds": seconds,
        "repeats": repeats,
        "rows": [asdict(r) for r in rows],
        "rps_on_over_off": {
            "per_repeat": [round(v, 3) for v in paired],
            "median": round(rps_ratio, 3),
            "spread": round(spread(paired), 3),
        },
        "hit_ratio": ratios,
        "p50_cache_over_online_c1": round(p50_ratio, 3),
        "goals": [
            {
                "goal": f"req/s tiers on / off at c={concurrency} >= {GOAL_RPS_RATIO}",
                "measured": round(rps_ratio, 3),
                "met": rps_ratio >= GOAL_RPS_RATIO,
            },
            {
                "goal": f"p50 c=1 cache / online <= {GOAL_P50_RATIO}",
                "measured": round(p50_ratio, 3),
                "met": p50_ratio <= GOAL_P50_RATIO,
            },
        ],
        "rounds": [asdict(r) for r in rounds],
    }


def _paired(rounds: Sequence[Round]) -> list[float]:
    """Tiers-on req/s over tiers-off req/s, repeat by repeat (measured back to back)."""
    off = {r.repeat: r.rps for r in rounds if r.target == OFF}
    return [r.rps / off[r.repeat] for r in rounds if r.target == ON and off.get(r.repeat)]


def round_line(found: Round) -> str:
    return (
        f"  {found.target} c={found.concurrency} #{found.repeat}: {found.rps:.0f} "
        f"req/s, p50 {found.p50_ms:.2f} ms, mesh CPU "
        f"{sum(v for k, v in found.cpu_us.items() if k != 'client'):.0f} µs/answer"
    )


def as_report(report: Mapping[str, object]) -> BenchReport:
    """The run for people: the rows, tiers on over off, the hit ratio, the goals."""
    shown = BenchReport(
        "servemesh bench predict --tiers",
        report,
        title=f"mesh start-up: {report['startup_s']} s with {report['entities']:,} entities; "
        f"Zipf({report['zipf_a']}) mix; top {report['precomputed_entities']:,} precomputed "
        f"by a batch run in {report['precompute_s']} s (expected share of calls "
        f"{report['precomputed_share_expected']:.1%}); {report['repeats']} repeats of "
        f"{report['seconds']} s",
        width=120,
    )
    rows = report["rows"]
    assert isinstance(rows, list)
    columns = ("phase", "conc.", "req/s", "min-max", "spread", "p50 ms", "p99 ms",
               "mesh CPU µs/answer", "errors")  # fmt: skip
    title = "Predict through the edge, tiers off vs on (medians, min-max)"
    table = shown.table(title, columns, left={"phase"})
    for r in rows:
        table.add_row(
            *rate_cells(r),
            f"{r['rps_spread']:.0%}",
            f"{r['p50_ms_median']:.2f}",
            f"{r['p99_ms_median']:.2f}",
            f"{r['cpu_us_mesh_median']:.0f} ({r['cpu_us_mesh_min']:.0f}-"
            f"{r['cpu_us_mesh_max']:.0f})",
            str(r["errors"]),
        )
    ratio = report["rps_on_over_off"]
    assert isinstance(ratio, dict)
    shown.ratio("req/s on / off", ratio["median"], ratio["per_repeat"])
    hits = report["hit_ratio"]
    assert isinstance(hits, list)
    shown.note(
        "hit ratio per repeat (precomputed + cache): "
        + ", ".join(f"{h['hit']:.1%} ({h['precomputed']:.1%} + {h['cache']:.1%})" for h in hits)
    )
    shown.note(f"p50 c=1 cache / online: {report['p50_cache_over_online_c1']:.2f}")
    goals = report["goals"]
    assert isinstance(goals, list)
    for goal in goals:
        shown.note(f"  {goal['goal']}: {goal['measured']} {'met' if goal['met'] else 'MISSED'}")
    return shown


def main(
    spec: str | None,
    *,
    entities: int,
    precompute: int,
    concurrency: list[int],
    seconds: float,
    repeats: int,
    quiet: bool = False,
    freshness: Literal["read", "feed"] = "read",
) -> BenchReport:
    """`servemesh bench predict --tiers`: at the largest of the concurrencies asked."""
    return as_report(
        bench_tiers(
            load_spec(spec),
            entities=entities,
            precomputed=precompute,
            concurrency=max(concurrency),
            seconds=seconds,
            repeats=repeats,
            freshness=freshness,
            progress=progress(quiet, round_line),
        )
    )
