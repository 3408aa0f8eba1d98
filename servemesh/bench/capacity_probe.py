"""The step load behind a capacity plan: a mesh of its own from the spec, one replica of
each kind in one zone, driven open loop at rising rates until the SLO breaks.

Each step offers `rate` Predicts a second for `step_s` through the edge (as a caller
would: Envoy, a gateway, a feature service, a model server), then reads what each kind's
process spent in CPU over the step (the services' own /metrics, /proc for Envoy and
Redis) and its resident memory. The next step offers `factor` times the rate. The probe
stops at the first step over the SLO (p99 of answered calls above it, or more than
MAX_FAILED_SHARE failed), or after `max_steps`.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from servemesh.bench.predict import one_zone_spec
from servemesh.capacity.plan import KINDS, Step
from servemesh.contract.errors import ServemeshError
from servemesh.identity import dial_every_edge
from servemesh.launcher import Mesh
from servemesh.load import FixedRate, Target, open_loop, percentile, predict_target
from servemesh.observe.cpu import rss_bytes
from servemesh.observe.top import MeshSnapshot, cost_between
from servemesh.spec import MeshSpec
from servemesh.state.credentials import EdgeAuthMetadata

# Answers still out when a step's schedule ends are waited for this long at most.
DRAIN_S = 5.0
# Predicts answered in a row before the first step: the mesh is up and warm.
WARM_CALLS = 50


class ProbeFailed(ServemeshError):
    """The probe's own mesh never answered (a model or entity ids it cannot serve)."""


def probe_spec(spec: MeshSpec, state_dir: str) -> MeshSpec:
    """The spec's models, views and settings on one replica of each kind in its first
    zone, free ports, no Prometheus, no scaler, no streams or batch jobs."""
    return one_zone_spec(spec).model_copy(
        update={
            "scaling": spec.scaling.model_copy(update={"enabled": False}),
            "streams": [],
            "batch": [],
            "state_dir": state_dir,
        }
    )


def _kind_pids(mesh: Mesh) -> dict[str, int]:
    found: dict[str, int] = {}
    pids = mesh.pids()
    for kind in KINDS:
        if kind in ("envoy", "redis"):
            if kind in pids:
                found[kind] = pids[kind]
            continue
        of_kind = mesh.pids_of(kind)
        if of_kind:
            found[kind] = next(iter(of_kind.values()))
    return found


def probe(
    spec: MeshSpec,
    model: str,
    *,
    p99_ms: float,
    start_rps: float,
    factor: float,
    step_s: float,
    max_steps: int,
    entity_ids: Sequence[str] = (),
    progress: Callable[[Step], None] = lambda _: None,
) -> list[Step]:
    """The steps measured, in rising order; the last is the first over the SLO unless
    `max_steps` came first."""
    if factor <= 1:
        raise ValueError(f"factor must be above 1, got {factor}")
    steps: list[Step] = []
    with tempfile.TemporaryDirectory(prefix="servemesh-capacity-") as state:
        mesh = Mesh.from_spec(probe_spec(spec, state), Path(state))
        with mesh:
            live = mesh.spec
            auth = EdgeAuthMetadata(live, "servemesh-capacity-plan")

            def target(timeout_s: float) -> Target:
                return predict_target(
                    dial_every_edge(live),
                    model=model,
                    entities=max(1, live.demo.entities),
                    entity_ids=entity_ids,
                    timeout_s=timeout_s,
                    metadata=auth.metadata,
                )

            _warm(target(5.0))
            rate = start_rps
            timeout_s = max(1.0, p99_ms * 10 / 1000)
            for _ in range(max_steps):
                pids = _kind_pids(mesh)
                before = MeshSnapshot.take(live, mesh.pids())
                schedule = FixedRate(rate, step_s)
                run = asyncio.run(open_loop(target(timeout_s), schedule, drain_s=DRAIN_S))
                after = MeshSnapshot.take(live, mesh.pids())
                outcomes = run.snapshot()
                answered = [o.latency_ms for o in outcomes if o.ok]
                spent = cost_between(before, after, live)
                step = Step(
                    rate_rps=round(rate, 2),
                    seconds=step_s,
                    calls=len(outcomes),
                    ok=len(answered),
                    p99_ms=round(percentile(answered, 99), 2) if answered else float("inf"),
                    cpu_seconds={
                        k: round(v, 4) for k, v in spent.cpu_by_part.items() if k in KINDS
                    },
                    rss_gib={
                        k: round((rss_bytes(pid) or 0) / 1024**3, 4) for k, pid in pids.items()
                    },
                    gpus=spent.gpus,
                )
                steps.append(step)
                progress(step)
                if not step.within(p99_ms):
                    break
                rate *= factor
    return steps


def _warm(target: Target) -> None:
    """Until WARM_CALLS Predicts in a row are answered (the model loaded, caches filled)."""
    codes: list[str] = []
    for _ in range(20):
        run = asyncio.run(open_loop(target, FixedRate(100.0, WARM_CALLS / 100.0), drain_s=10))
        codes = sorted({o.code for o in run.snapshot() if not o.ok})
        if not codes:
            return
    raise ProbeFailed(f"the probe's mesh does not answer the model's Predicts: {codes}")
