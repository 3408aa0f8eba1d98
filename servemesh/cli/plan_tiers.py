"""`servemesh batch plan-tiers M --top N`: the precomputed set from traffic.

Reads the prediction log (Parquet under the state dir, or the spec's PostgreSQL) and writes
the N ids of the model's entity that its calls named most as an entities file (CSV, one
column named after the entity or the job's `entity_column`): a `batch:` job's `entities`
file (`--job NAME`) or `--out FILE`. The next run of the job scores them into Redis, the
precomputed tier serves them, the cache takes the next tier, the model the long tail
(docs/tiers.md).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from servemesh.cli.flags import add_output
from servemesh.cli.mesh import add_mesh_flags
from servemesh.cli.output import out, write
from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.errors import ServemeshError, UsageError
from servemesh.spec import MeshSpec, SpecError

if TYPE_CHECKING:
    from servemesh.predlog.query import TopEntities


@dataclass(frozen=True)
class TierPlan:
    """Where the set goes and the column it is written under."""

    path: Path
    column: str
    entity: str


def plan_target(spec: MeshSpec, model: str, job: str | None, out_file: str | None) -> TierPlan:
    """The file and column for `model`'s set; UsageError when the flags or the job do not
    fit (a job of another model, or one that scores a whole view)."""
    if (job is None) == (out_file is None):
        raise UsageError("give --job NAME (the spec job's entities file) or --out FILE")
    found = spec.models.get(model)
    if found is None:
        raise UsageError(f"no model named {model!r}; models: {', '.join(sorted(spec.models))}")
    entity = spec.entities_of(found)[0]
    if out_file is not None:
        return TierPlan(Path(out_file), entity, entity)
    assert job is not None
    try:
        job_spec = spec.batch_job(job)
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    if job_spec.model != model:
        raise UsageError(f"--job {job}: scores model {job_spec.model}, not {model}")
    if job_spec.entities is None:
        raise UsageError(
            f"--job {job}: scores a whole view; give the job `entities: FILE` to score a "
            "set, or write one with --out"
        )
    return TierPlan(Path(job_spec.entities), job_spec.entity_column or entity, entity)


def entities_csv(column: str, ids: list[str]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([column])
    writer.writerows([i] for i in ids)
    return buffer.getvalue()


def _plan_data(model: str, since: str, plan: TierPlan, top: TopEntities) -> dict[str, object]:
    """What the table and its last line show: every id written (rank, calls, the share of
    lookups covered so far), where they went, and what they cover."""
    ranked = []
    covered = 0
    for rank, (entity, calls) in enumerate(top.rows, 1):
        covered += calls
        ranked.append({"rank": rank, "id": entity, "calls": calls, "covered": covered / top.calls})
    return {
        "model": model,
        "entity": plan.entity,
        "since": since,
        "file": str(plan.path),
        "written": len(top.rows),
        "distinct": top.distinct,
        "lookups": top.calls,
        "covered_lookups": covered,
        "covered": covered / top.calls,
        "top": ranked,
    }


def cmd_plan_tiers(args: argparse.Namespace) -> int:
    from servemesh.cli.log import _spec_and_state
    from servemesh.predlog.query import parse_since, reader_for

    if args.top < 1:
        raise UsageError("--top: give 1 or more")
    try:
        since_s = parse_since(args.since)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    spec, state_dir = _spec_and_state(args)
    plan = plan_target(spec, args.model, args.job, args.out)
    try:
        reader = reader_for(spec.prediction_log, state_dir)
        # The log holds no more than its retention, whatever --since asks.
        since_s = min(since_s, spec.prediction_log.retention_s)
        top = reader.top_entities(args.model, plan.entity, since_s, args.top)
    except Exception as exc:
        raise ServemeshError(f"the prediction log could not be read: {exc}") from None
    if not top.rows:
        raise ServemeshError(
            f"no calls of {args.model} naming a {plan.entity} in the last {args.since}: "
            "nothing written"
        )
    ids = [entity for entity, _ in top.rows]
    plan.path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(plan.path, entities_csv(plan.column, ids))
    if args.json:
        write(json.dumps(_plan_data(args.model, args.since, plan, top)))
        return 0

    table = Table(box=None, pad_edge=False)
    for column in ("rank", plan.entity, "calls", "covered"):
        table.add_column(column, justify="left" if column == plan.entity else "right")
    covered = 0
    for rank, (entity, calls) in enumerate(top.rows, 1):
        covered += calls
        if rank <= args.show:
            table.add_row(str(rank), entity, f"{calls:,}", f"{covered / top.calls:.1%}")
    out.print(table)
    if len(top.rows) > args.show:
        out.print(f"... {len(top.rows) - args.show:,} more in the file", markup=False)
    out.print(
        f"wrote {len(ids):,} of {top.distinct:,} {plan.entity} ids to {plan.path}: "
        f"{covered:,} of {top.calls:,} {plan.entity} lookups of {args.model} in the last "
        f"{args.since} ({covered / top.calls:.1%})",
        markup=False,
    )
    return 0


def register(verbs: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = verbs.add_parser(
        "plan-tiers",
        help="write the entities a model's calls named most as a batch job's entities file",
        description="Reads the prediction log (the last --since of it) and writes the --top "
        "N ids of the model's entity by calls as a CSV entities file: the file the spec job "
        "--job names in its `entities` field (its next run precomputes them; the model's "
        "tiers serve them), or --out FILE. Prints each id's calls and the share of the "
        "model's entity lookups the top ids cover so far.",
    )
    p.add_argument("model", help="the model whose calls are counted")
    p.add_argument("--top", type=int, required=True, help="how many ids to keep")
    p.add_argument("--since", default="7d", help="how far back to count (default 7d)")
    p.add_argument("--job", help="write the entities file this spec batch job names")
    p.add_argument("--out", help="write this CSV file instead")
    p.add_argument("--show", type=int, default=20, help="rows of the table printed (default 20)")
    add_output(p, "the ids written, their calls and what they cover, as JSON")
    add_mesh_flags(p, inherited=True)
    p.set_defaults(func=cmd_plan_tiers, error_label="not planned")
