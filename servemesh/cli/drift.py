"""`servemesh drift MODEL`: how far a model's live inputs moved from its reference, per
feature, from the prediction log (servemesh/predlog/drift.py); `--set-reference FILE`
keeps a reference, summarised, under the state dir for the command and the registry's
drift gauges (docs/operators.md, "Drift on live traffic")."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from servemesh.cli.flags import add_duration, add_output
from servemesh.cli.mesh import add_mesh_flags
from servemesh.cli.output import out, write
from servemesh.contract.errors import ServemeshError, UsageError

if TYPE_CHECKING:
    from servemesh.predlog.drift import DriftReport, Reference
    from servemesh.spec import MeshSpec

DESCRIPTION = (
    "Compares the feature values the prediction log kept of MODEL's calls (a model whose "
    "spec sets log_features: true) over --window with a reference sample: per feature, "
    "PSI on the reference's decile bins (numbers) or category shares (text, booleans, "
    "--categorical columns), a chi-square test's p-value, the values compared and a "
    "verdict: drifting at PSI >= prediction_log.drift.psi_drifting (0.2) with p < "
    "drift.p_value (0.01), watch at PSI >= drift.psi_watch (0.1), too few rows under "
    "drift.min_rows (200). The reference is --reference FILE.parquet, else the one "
    "--set-reference kept (the version's, else the model's). Exit statuses: 0 the report "
    "(whatever the verdicts), 1 no reference, an unreadable file or a model the mesh does "
    "not serve, 2 usage, 5 no mesh or recorded log at the state dir."
)


def _model_of(spec: MeshSpec, model: str, version: str | None) -> None:
    served = spec.models.get(model)
    if served is None:
        raise ServemeshError(f"model {model!r} is not served; models: {sorted(spec.models)}")
    if version is not None and version not in served.versions:
        raise ServemeshError(
            f"--version: model {model!r} has no version {version!r}; versions: "
            f"{sorted(served.versions)}"
        )


def cmd_drift(args: argparse.Namespace) -> int:
    from servemesh.cli.log import _spec_and_state

    actions = [args.set_reference, args.show_reference, args.remove_reference]
    if sum(bool(a) for a in actions) > 1:
        raise UsageError("--set-reference, --show-reference, --remove-reference: give one")
    if (args.set_reference or args.show_reference or args.remove_reference) and (
        args.reference or args.window is not None
    ):
        raise UsageError(
            "--reference and --window report drift; they do not go with a reference change"
        )
    if args.categorical and not (args.set_reference or args.reference):
        raise UsageError("--categorical: goes with --set-reference FILE or --reference FILE")
    if args.window is not None and args.window <= 0:
        raise UsageError("--window: give a duration longer than 0")
    spec, state_dir = _spec_and_state(args)
    _model_of(spec, args.model, args.version)
    if args.set_reference:
        return _set_reference(args, state_dir)
    if args.show_reference:
        return _show_reference(args, state_dir)
    if args.remove_reference:
        return _remove_reference(args, state_dir)
    return _report(args, spec, state_dir)


def _set_reference(args: argparse.Namespace, state_dir: Path) -> int:
    from servemesh.predlog.drift import NumericSummary
    from servemesh.predlog.references import reference_from_parquet, save_reference

    reference, skipped = reference_from_parquet(
        Path(args.set_reference), args.model, args.version, categorical=args.categorical or ()
    )
    path = save_reference(state_dir, reference)
    if args.json:
        write(json.dumps({"reference": str(path), "skipped": skipped, **_summary(reference)}))
        return 0
    numeric = sum(isinstance(s, NumericSummary) for s in reference.features.values())
    whose = args.model + (f" {args.version}" if args.version else "")
    out.print(
        f"reference of {whose} set from {args.set_reference}: {reference.rows:,} rows, "
        f"{len(reference.features)} features ({numeric} numeric, "
        f"{len(reference.features) - numeric} categorical); kept summarised at {path}",
        markup=False,
    )
    if skipped:
        out.print(f"columns left out (neither numbers, text nor booleans): {', '.join(skipped)}")
    return 0


def _summary(reference: Reference) -> dict[str, Any]:
    data = reference.model_dump(mode="json")
    return {k: v for k, v in data.items() if k != "features"} | {
        "features": {name: s["kind"] for name, s in data["features"].items()}
    }


def _show_reference(args: argparse.Namespace, state_dir: Path) -> int:
    from servemesh.predlog.drift import NumericSummary
    from servemesh.predlog.references import find_reference

    reference = find_reference(state_dir, args.model, args.version)
    if args.json:
        write(reference.model_dump_json())
        return 0
    whose = reference.model + (f" {reference.version}" if reference.version else "")
    out.print(
        f"reference of {whose}: {reference.source}, {reference.rows:,} rows, set "
        f"{reference.created}",
        markup=False,
    )
    table = Table()
    for column in ("feature", "kind", "bins", "reference"):
        table.add_column(column)
    for name, summary in reference.features.items():
        if isinstance(summary, NumericSummary):
            shown = f"mean {summary.mean:.3g}, std {summary.std:.3g}"
            table.add_row(name, "numeric", str(len(summary.counts)), shown)
            continue
        total = sum(summary.counts) + summary.other
        top = ", ".join(
            f"{c} {n / total:.0%}"
            for c, n in zip(summary.categories[:3], summary.counts[:3], strict=True)
        )
        bins = len(summary.categories) + (1 if summary.other else 0)
        table.add_row(name, "categorical", str(bins), top)
    out.print(table)
    return 0


def _remove_reference(args: argparse.Namespace, state_dir: Path) -> int:
    from servemesh.predlog.references import reference_path, remove_reference

    whose = args.model + (f" {args.version}" if args.version else "")
    if not remove_reference(state_dir, args.model, args.version):
        raise ServemeshError(
            f"{whose} has no drift reference of its own at "
            f"{reference_path(state_dir, args.model, args.version)}"
        )
    out.print(f"reference of {whose} removed: its drift gauges go at the registry's next round")
    return 0


def _report(args: argparse.Namespace, spec: MeshSpec, state_dir: Path) -> int:
    from servemesh.predlog.query import reader_for
    from servemesh.predlog.references import (
        drift_report,
        find_reference,
        reference_from_parquet,
    )

    if args.reference:
        reference, _ = reference_from_parquet(
            Path(args.reference), args.model, args.version, categorical=args.categorical or ()
        )
    else:
        reference = find_reference(state_dir, args.model, args.version)
    settings = spec.prediction_log.drift
    window_s = settings.window_s if args.window is None else args.window
    # The log holds no more than its retention, whatever --window asks.
    window_s = min(window_s, spec.prediction_log.retention_s)
    try:
        reader = reader_for(spec.prediction_log, state_dir)
        report = drift_report(
            reader, reference, settings, model=args.model, version=args.version, window_s=window_s
        )
    except Exception as exc:  # the store: a database down, a file being replaced
        raise ServemeshError(f"the prediction log could not be read: {exc}") from None
    if args.json:
        write(json.dumps(report.as_dict()))
        return 0
    _print_report(report, spec)
    return 0


def _window_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _p_text(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    return "<1e-300" if value < 1e-300 else f"{value:.2g}"


def _print_report(report: DriftReport, spec: MeshSpec) -> None:
    settings = spec.prediction_log.drift
    whose = (
        f"{report.model} {report.version}" if report.version else f"{report.model}, every version"
    )
    window = _window_text(report.window_s)
    out.print(
        f"{whose}: {report.calls:,} calls in the last {window}, {report.with_values:,} with "
        f"feature values ({report.read:,} read)",
        markup=False,
    )
    ref = report.reference
    of = f" (version {ref.version}'s)" if ref.version else ""
    out.print(f"reference{of}: {ref.source}, {ref.rows:,} rows, set {ref.created}", markup=False)
    table = Table()
    for column in ("feature", "kind", "rows", "PSI", "p-value", "verdict", "shift"):
        table.add_column(
            column, justify="right" if column in ("rows", "PSI", "p-value") else "left"
        )
    for f in report.features:
        psi = "-" if f.psi is None else f"{f.psi:.3f}"
        verdict = f"[red]{f.verdict}[/red]" if f.verdict == "drifting" else f.verdict
        table.add_row(f.feature, f.kind, f"{f.rows:,}", psi, _p_text(f.p_value), verdict, f.detail)
    out.print(table)
    drifting = report.drifting
    rule = f"PSI >= {settings.psi_drifting:g} with p < {settings.p_value:g}"
    if drifting:
        out.print(
            f"{len(drifting)} of {len(report.features)} features drifting ({rule}): "
            f"{', '.join(drifting)}",
            markup=False,
        )
    else:
        out.print(f"no feature drifting ({rule})", markup=False)
    model = spec.models.get(report.model)
    if report.calls and not report.with_values and model is not None and not model.log_features:
        out.print(
            f"the log keeps no feature values of {report.model}: set `log_features: true` on "
            "the model (servemesh apply)",
            markup=False,
        )


def register(sub: Any) -> None:
    p = sub.add_parser(
        "drift",
        help="how far a model's live inputs moved from its reference, per feature",
        description=DESCRIPTION,
    )
    p.add_argument("model", help="the model whose calls are compared")
    p.add_argument("--version", help="only this version's calls (and its own reference, if set)")
    add_duration(
        p,
        "--window",
        "the calls of this long back (default: prediction_log.drift.window, 1h)",
        dest="window",
        default=None,
    )
    p.add_argument(
        "--reference",
        metavar="FILE",
        help="compare with this Parquet file of feature rows (one column per feature)",
    )
    p.add_argument(
        "--set-reference",
        metavar="FILE",
        help="keep this Parquet file, summarised, as the model's reference (the version's "
        "with --version)",
    )
    p.add_argument(
        "--show-reference", action="store_true", help="print the reference kept, summarised"
    )
    p.add_argument("--remove-reference", action="store_true", help="forget the reference kept")
    p.add_argument(
        "--categorical",
        action="append",
        metavar="COLUMN",
        help="a column of numbers that are categories (codes); repeatable",
    )
    add_output(p, "the report as one JSON object")
    add_mesh_flags(p)
    p.set_defaults(func=cmd_drift, error_label="drift")
