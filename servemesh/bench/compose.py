"""`servemesh bench compose`: Predict through the compose mesh's edge against `servemesh up`'s,
in one run.

Both meshes have the compose file's shape (deploy/compose/mesh-dns.yaml: two zones, a
gateway, a feature service and a model server in each, the edge's Envoy and one per zone,
no Prometheus, no trace store), and both run for the whole bench: the compose project
started with `make compose-up` on the local images (containers on one bridge network,
Envoy resolving names), and the same spec as processes on loopback (`Mesh`, the file
catalog). Every repeat measures each mesh at each concurrency in turn, the order of the
two meshes turning between repeats, so a slower or busier minute of the host falls on
both. The ratios are compose over up, per repeat: the price of containers (a bridge, NAT
to the published edge port, name resolution) on one host.

The goals are issue-level figures: req/s at c=64 at least 0.8x, p50 at c=1 at most 1.5x.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from statistics import median

from servemesh.bench.predict import Round, measure
from servemesh.bench.report import BenchReport, progress
from servemesh.contract.errors import UsageError
from servemesh.identity.channels import dial_edge_at, dial_edges
from servemesh.launcher import Mesh
from servemesh.load import Target, predict_target
from servemesh.spec import (
    DiscoverySpec,
    FeatureStoreSpec,
    MeshSpec,
    Ports,
    TlsSpec,
    load_spec,
)
from servemesh.state.credentials import EdgeAuthMetadata

# The checkout this module is in: `make compose-up` and the compose files live there.
CHECKOUT = Path(__file__).resolve().parents[2]
COMPOSE_SPEC = CHECKOUT / "deploy" / "compose" / "mesh-dns.yaml"
RENDERED_STATE = CHECKOUT / "deploy" / "compose" / "rendered-dns" / "state"
# A project of its own, so a compose mesh someone started by hand is left alone.
PROJECT = "servemesh-bench"
ENTITIES = 1000
ARMS = ("up", "compose")
GOALS = {"rps_c64_min": 0.8, "p50_c1_max": 1.5}


def engine_missing() -> str | None:
    """Why no compose mesh can start here, or None."""
    for tool in ("docker", "docker-compose", "make"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH (docs/multihost.md: a Docker engine and docker-compose)"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        return "no Docker engine answers: " + (info.stderr.strip().splitlines() or ["?"])[-1]
    if not COMPOSE_SPEC.exists():
        return f"{COMPOSE_SPEC} is missing: run this from a checkout of servemesh"
    return None


def up_spec(compose: MeshSpec, state_dir: Path) -> MeshSpec:
    """The compose file's mesh as processes on this host: its zones, replicas, proxy
    layout and switches, with loopback's discovery, store, certificates and free ports."""
    return compose.model_copy(
        update={
            "state_dir": str(state_dir),
            "ports": Ports.free(),
            "discovery": DiscoverySpec(),
            "feature_store": FeatureStoreSpec(),
            "tls": TlsSpec(),
        }
    )


def rendered_compose_spec() -> MeshSpec:
    """The compose mesh's spec as a caller on the host dials it: the declared file with the
    state dir `make compose-up` rendered (its CA, the edge's credentials)."""
    compose = load_spec(str(COMPOSE_SPEC))
    return compose.model_copy(update={"state_dir": str(RENDERED_STATE)})


def edge_target(
    spec: MeshSpec, address: str, *more: str, subject: str, entities: int = ENTITIES
) -> Target:
    """Predict through the edge at `address` (and every edge in `more`, as a caller given
    each zone's edge connects: identity.dial_edges) over the TLS `spec` names, with the
    edge credentials of its state dir (a token signed for `subject`, or the basic ones)."""
    return predict_target(
        dial_edges(spec, [address, *more]) if more else dial_edge_at(spec, address),
        entities=entities,
        timeout_s=5.0,
        metadata=EdgeAuthMetadata(spec, subject).metadata,
    )


def _make(target: str, edge_port: int, timeout_s: float) -> subprocess.CompletedProcess[str]:
    # Zone-b's edge on the port after the first's (nothing of the bench dials it).
    env = {
        **os.environ,
        "SERVEMESH_EDGE_PORT": str(edge_port),
        "SERVEMESH_ZONE_B_EDGE_PORT": str(edge_port + 1),
    }
    return subprocess.run(
        ["make", target, f"COMPOSE_PROJECT={PROJECT}"],
        cwd=CHECKOUT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def compose_up(edge_port: int, say: Callable[[str], None]) -> float:
    """`make compose-up` (images built or reused, every container healthy); its seconds."""
    started = time.monotonic()
    done = _make("compose-up", edge_port, 1800)
    if done.returncode != 0:
        raise UsageError("make compose-up failed:\n" + (done.stdout + done.stderr)[-3000:])
    took = time.monotonic() - started
    say(f"compose mesh healthy in {took:.1f} s (edge 127.0.0.1:{edge_port})")
    return took


def compose_down(edge_port: int) -> None:
    _make("compose-down", edge_port, 300)


def ratio_rows(rounds: Sequence[Round], concurrencies: Sequence[int]) -> dict[str, object]:
    """Per concurrency: each arm's req/s and p50 (median, min, max), and compose over up
    per repeat."""
    found: dict[str, object] = {}
    for c in concurrencies:
        by_arm = {
            arm: [r for r in rounds if r.target == arm and r.concurrency == c] for arm in ARMS
        }
        repeats = sorted({r.repeat for r in rounds if r.concurrency == c})
        paired = [
            (
                next(r for r in by_arm["up"] if r.repeat == k),
                next(r for r in by_arm["compose"] if r.repeat == k),
            )
            for k in repeats
        ]
        found[str(c)] = {
            "arms": {
                arm: {
                    figure: _spread([getattr(r, figure) for r in by_arm[arm]])
                    for figure in ("rps", "p50_ms", "p99_ms")
                }
                | {"errors": sum(r.errors for r in by_arm[arm])}
                for arm in ARMS
            },
            "rps_ratio": [round(c_.rps / u.rps, 3) if u.rps else None for u, c_ in paired],
            "p50_ratio": [round(c_.p50_ms / u.p50_ms, 3) if u.p50_ms else None for u, c_ in paired],
        }
    return found


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": median(values), "min": min(values), "max": max(values)}


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(median(known), 3) if known else None


def bench_compose(
    *,
    concurrencies: Sequence[int],
    seconds: float,
    repeats: int,
    edge_port: int,
    say: Callable[[str], None],
    progress_of: Callable[[Round], None],
) -> dict[str, object]:
    reason = engine_missing()
    if reason is not None:
        raise UsageError(f"servemesh bench compose: {reason}")
    compose = load_spec(str(COMPOSE_SPEC))
    rounds: list[Round] = []
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-compose-")))
        # Down first when anything below fails, then the local mesh (the stack unwinds last
        # in, first out).
        up = stack.enter_context(Mesh.from_spec(up_spec(compose, work / "up")))
        say(f"servemesh up mesh ready (edge {up.spec.edge_address})")
        stack.callback(compose_down, edge_port)
        up_s = compose_up(edge_port, say)
        targets = {
            "up": edge_target(up.spec, up.spec.edge_address, subject="bench-compose"),
            "compose": edge_target(
                rendered_compose_spec(), f"127.0.0.1:{edge_port}", subject="bench-compose"
            ),
        }
        for repeat in range(repeats):
            order = ARMS if repeat % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                for c in concurrencies:
                    found = measure(up, targets[arm], arm, c, seconds, repeat, cpu_of=_no_cpu)
                    rounds.append(found)
                    progress_of(found)
    rows = ratio_rows(rounds, concurrencies)
    return {
        "command": "servemesh bench compose",
        "repeats": repeats,
        "seconds": seconds,
        "concurrencies": list(concurrencies),
        "compose_up_s": round(up_s, 1),
        "rounds": [asdict(r) for r in rounds],
        "by_concurrency": rows,
        "goals": GOALS,
    }


def _no_cpu() -> Mapping[str, float]:
    # The containers' CPU is the engine's to read, not /proc's of this mesh: none is read.
    return {}


def round_line(found: Round) -> str:
    return (
        f"  {found.target:<8} c={found.concurrency:<3} #{found.repeat + 1}: "
        f"{found.rps:.0f} req/s, p50 {found.p50_ms:.2f} ms, p99 {found.p99_ms:.2f} ms, "
        f"{found.errors} failed"
    )


def as_report(report: Mapping[str, object]) -> BenchReport:
    rows = report["by_concurrency"]
    assert isinstance(rows, dict)
    shown = BenchReport(
        "servemesh bench compose",
        report,
        title=f"compose (containers, make compose-up) against up (processes), the same spec; "
        f"{report['repeats']} repeats of {report['seconds']} s per concurrency, order turning",
        width=100,
    )
    table = shown.table("Predict through the edge", ("c", "arm", "req/s", "p50 ms", "p99 ms",
                                                     "failed"), left=("arm",))  # fmt: skip
    failed = 0
    for c, row in rows.items():
        for arm in ARMS:
            figures = row["arms"][arm]
            failed += figures["errors"]
            table.add_row(
                c,
                arm,
                _cell(figures["rps"], 0),
                _cell(figures["p50_ms"], 2),
                _cell(figures["p99_ms"], 2),
                str(figures["errors"]),
            )
    for c, row in rows.items():
        for name, key in (("req/s", "rps_ratio"), ("p50", "p50_ratio")):
            values = [v for v in row[key] if v is not None]
            if values:
                shown.ratio(f"c={c} {name} compose/up", median(values), values)
    checks = []
    if "64" in rows:
        rps = _median(rows["64"]["rps_ratio"])
        checks.append(("c=64 req/s compose/up", rps, f">= {GOALS['rps_c64_min']}",
                       rps is not None and rps >= GOALS["rps_c64_min"]))  # fmt: skip
    if "1" in rows:
        p50 = _median(rows["1"]["p50_ratio"])
        checks.append(("c=1 p50 compose/up", p50, f"<= {GOALS['p50_c1_max']}",
                       p50 is not None and p50 <= GOALS["p50_c1_max"]))  # fmt: skip
    goals = shown.table("goals, same run", ("figure", "measured", "goal", "met"),
                        left=("figure",))  # fmt: skip
    for name, value, goal, met in checks:
        goals.add_row(name, "-" if value is None else f"{value:.2f}x", goal, "yes" if met else "no")
    shown.note(f"compose mesh healthy in {report['compose_up_s']} s (make compose-up)")
    shown.status = 1 if failed else 0
    return shown


def _cell(figure: Mapping[str, float], digits: int) -> str:
    return f"{figure['median']:.{digits}f} ({figure['min']:.{digits}f}-{figure['max']:.{digits}f})"


def main(
    *,
    concurrency: Sequence[int],
    seconds: float,
    repeats: int,
    edge_port: int,
    quiet: bool = False,
) -> BenchReport:
    say = progress(quiet, str)
    return as_report(
        bench_compose(
            concurrencies=concurrency,
            seconds=seconds,
            repeats=repeats,
            edge_port=edge_port,
            say=say,
            progress_of=progress(quiet, round_line),
        )
    )
