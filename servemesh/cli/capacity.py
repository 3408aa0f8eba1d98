"""`servemesh capacity plan`: replicas per kind and their cost for a target rate at an SLO,
from a step load against one replica of each kind (docs/capacity.md)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from servemesh.cli.flags import add_duration, add_output, add_rate, add_slo, deprecated
from servemesh.cli.mesh import add_mesh_flags, state_dir_of
from servemesh.cli.output import out, write
from servemesh.contract.errors import ServemeshError, UsageError

if TYPE_CHECKING:
    from servemesh.capacity.plan import Plan, Step
    from servemesh.spec import MeshSpec


class NoKnee(ServemeshError):
    """No step of the load was within the SLO: nothing to plan from."""


def cmd_plan(args: argparse.Namespace) -> int:
    from servemesh.capacity.plan import (
        Step,
        capacities,
        knee,
        plan_for,
        read_measurement,
        save_measurement,
    )
    from servemesh.spec import load_spec

    for flag, value in (("--rate", args.rate), ("--slo", args.slo_ms)):
        if value is None:
            raise UsageError(f"{flag} is required")
    spec = load_spec(args.spec)
    if args.model not in spec.models:
        raise UsageError(f"--model: {args.model!r} is not one of the spec's {sorted(spec.models)}")
    state_dir = state_dir_of(args)
    if args.measured:
        record = read_measurement(state_dir, args.model)
        if record is None:
            raise UsageError(
                f"--measured: no capacity plan of {args.model!r} recorded under {state_dir}; "
                "run `servemesh capacity plan` without it first"
            )
        steps = [Step(**s) for s in record["steps"]]
    else:
        steps = _probe(args, spec)
    found = knee(steps, args.slo_ms)
    if found is None:
        first = steps[0]
        raise NoKnee(
            f"no step within p99 {args.slo_ms:g} ms: at {first.rate_rps:g} req/s p99 was "
            f"{first.p99_ms:g} ms with {first.failed_share:.1%} failed; lower --start-rate or "
            "raise --slo"
        )
    caps = capacities(found, spec.cost.cores_per_replica)
    if not args.measured:
        save_measurement(state_dir, args.model, steps, caps, args.slo_ms)
    plan = plan_for(
        args.model,
        caps,
        target_rps=args.rate,
        p99_ms=args.slo_ms,
        headroom=args.headroom,
        cost=spec.cost,
        gpus_per_model_replica=found.gpus,
        at=found,
    )
    if args.json:
        write(
            json.dumps(
                {
                    "plan": asdict(plan),
                    "capacity": {k: asdict(c) for k, c in caps.items()},
                    "steps": [asdict(s) for s in steps],
                }
            )
        )
        return 0
    _print_steps(steps, args.slo_ms)
    _print_plan(plan)
    return 0


def _probe(args: argparse.Namespace, spec: MeshSpec) -> list[Step]:
    from servemesh.bench.capacity_probe import probe

    ids: list[str] = []
    if args.entity_ids:
        ids = [line.strip() for line in Path(args.entity_ids).read_text().splitlines()]
        ids = [i for i in ids if i]
        if not ids:
            raise UsageError(f"--entity-ids: {args.entity_ids} names no entity")

    def shown(step: Step) -> None:
        if not args.json:
            out.print(
                f"  {step.rate_rps:g} req/s: p99 {step.p99_ms:g} ms, "
                f"{step.calls - step.ok} of {step.calls} failed",
                markup=False,
            )

    if not args.json:
        out.print(
            f"step load on one replica of each kind: from {args.start_rate:g} req/s, "
            f"x{args.factor:g} each {args.step_s:g} s, until p99 > {args.slo_ms:g} ms",
            markup=False,
        )
    args.interrupted = "the capacity plan stopped; its mesh is stopped with it"
    return probe(
        spec,
        args.model,
        p99_ms=args.slo_ms,
        start_rps=args.start_rate,
        factor=args.factor,
        step_s=args.step_s,
        max_steps=args.max_steps,
        entity_ids=ids,
        progress=shown,
    )


def _print_steps(steps: list[Step], p99_ms: float) -> None:
    from servemesh.capacity.plan import KINDS

    table = Table(title="the step load (CPU: ms per answered call)")
    for column in ("offered req/s", "answered", "p99 ms", "within SLO", *KINDS):
        table.add_column(column, justify="right")
    for step in steps:
        per_call = [
            f"{step.cpu_seconds[k] / step.ok * 1000:.3f}" if step.ok and k in step.cpu_seconds
            else "-"
            for k in KINDS
        ]  # fmt: skip
        table.add_row(
            f"{step.rate_rps:g}",
            f"{step.ok}/{step.calls}",
            f"{step.p99_ms:g}",
            "yes" if step.within(p99_ms) else "no",
            *per_call,
        )
    out.print(table)


def _print_plan(plan: Plan) -> None:
    table = Table(
        title=f"{plan.model} at {plan.target_rps:g} req/s, p99 <= {plan.p99_ms:g} ms, "
        f"{plan.headroom:.0%} headroom"
    )
    for column in ("kind", "replicas", "req/s per replica", "utilisation", "$/hour"):
        table.add_column(column, justify="right" if column != "kind" else "left")
    for kind in plan.kinds:
        table.add_row(
            kind.kind,
            str(kind.replicas),
            f"{kind.rps_per_replica:g}",
            f"{kind.utilisation:.0%}",
            f"{kind.cost_per_hour:.4f}",
        )
    out.print(table)
    configuration = ", ".join(f"{k.kind} x{k.replicas}" for k in plan.kinds)
    prices = plan.prices
    out.print(
        f"configuration: {configuration}\n"
        f"cost: ${plan.cost_per_hour:.4f}/hour, ${plan.cost_per_million:.4f} per 1M predictions "
        f"at {plan.target_rps:g} req/s (${prices['per_core_hour']:g}/core-hour x "
        f"{prices['cores_per_replica']:g} per replica, ${prices['per_gib_hour']:g}/GiB-hour, "
        f"${prices['per_gpu_hour']:g}/GPU-hour)\n"
        f"measured whole: one replica of each kind held the SLO up to "
        f"{plan.knee_rps:g} req/s (p99 {plan.knee_p99_ms:g} ms) on this machine",
        markup=False,
    )


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    capacity = sub.add_parser(
        "capacity", help="how many replicas, at what cost, for a rate at an SLO"
    )
    add_mesh_flags(capacity)
    verbs = capacity.add_subparsers(dest="verb", required=True)
    plan = verbs.add_parser(
        "plan",
        help="step-load one replica of each kind (a mesh of its own from the spec) until "
        "the SLO breaks; print the replicas per kind for --rate, the headroom and the cost. "
        "The measured capacity is kept in the state dir: the scaler's forecast uses it",
    )
    add_mesh_flags(plan, inherited=True)
    plan.add_argument("--model", default="fraud", help="the model called (default fraud)")
    add_rate(plan, "Predicts/s", "the target rate", default=None)
    deprecated(plan, "--rps", "--rate", dest="rate", convert=float)
    add_slo(plan, default=None)
    deprecated(plan, "--p99-ms", "--slo", dest="slo_ms", convert=float)
    plan.add_argument(
        "--headroom",
        type=float,
        default=0.3,
        help="share of each replica's capacity left free at the target rate (default 0.3)",
    )
    plan.add_argument(
        "--start-rate", type=float, default=25.0, help="the first step's rate (Predicts/s)"
    )
    deprecated(plan, "--start-rps", "--start-rate", dest="start_rate", convert=float)
    plan.add_argument("--factor", type=float, default=1.6, help="each step's rate over the last")
    add_duration(
        plan, "--step", "how long each step lasts (default 5s)", dest="step_s", default=5.0
    )
    deprecated(plan, "--step-s", "--step", dest="step_s", convert=float)
    plan.add_argument("--max-steps", type=int, default=12)
    plan.add_argument(
        "--entity-ids",
        help="a file of entity ids to call with, one a line (default: the demo's user-N)",
    )
    plan.add_argument(
        "--measured",
        action="store_true",
        help="plan from the last measurement kept in the state dir (no step load)",
    )
    add_output(plan)
    plan.set_defaults(func=cmd_plan)
