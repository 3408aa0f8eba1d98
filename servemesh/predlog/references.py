"""Drift references under the state dir, and the drift of one model's live calls against
its reference (what `servemesh drift` prints and the registry's drift gauges export).

A reference is set from a Parquet file of feature rows, one column per feature (the model's
training sample, or any sample the operator trusts): `reference_from_parquet` summarises it
(servemesh/predlog/drift.py) and `save_reference` keeps the summary, not the rows, at
`<state_dir>/drift/<model>.json`, or `<model>@<version>.json` for one version's. A version's
calls are compared with the version's own reference where it has one, else the model's.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from pydantic import ValidationError

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.errors import ServemeshError
from servemesh.contract.private import private_dir
from servemesh.predlog.drift import (
    BINS,
    MAX_CATEGORIES,
    CategoricalSummary,
    DriftReport,
    NumericSummary,
    Reference,
    compare,
    gather,
    summarise_categorical,
    summarise_numeric,
)
from servemesh.predlog.query import FeatureRecords
from servemesh.spec import DriftSpec

FOLDER = "drift"


class NoReference(ServemeshError):
    """The model (version) has no drift reference, or its file cannot be used."""


class FeatureLog(Protocol):
    """What drift reads of the prediction log (query.py's readers)."""

    def feature_records(
        self, model: str, version: str | None, since_s: float, limit: int
    ) -> FeatureRecords: ...


def references_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / FOLDER


def reference_path(state_dir: str | Path, model: str, version: str | None = None) -> Path:
    name = model if version is None else f"{model}@{version}"
    return references_dir(state_dir) / f"{name}.json"


def reference_from_parquet(
    path: Path,
    model: str,
    version: str | None = None,
    *,
    categorical: Iterable[str] = (),
    bins: int = BINS,
    max_categories: int = MAX_CATEGORIES,
) -> tuple[Reference, list[str]]:
    """The summary of a Parquet file's columns, and the columns left out (neither numbers,
    text nor booleans: lists, times). Numbers are numeric features unless named in
    `categorical` (codes stored as integers); text, booleans and dictionary columns are
    categorical. NoReference names what is wrong with the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise NoReference(f"{path}: not a readable Parquet file: {exc}") from None
    if table.num_rows == 0:
        raise NoReference(f"{path}: holds no rows")
    as_categories = set(categorical)
    unknown = sorted(as_categories - set(table.column_names))
    if unknown:
        raise NoReference(f"--categorical: {path} has no column {unknown[0]!r}")
    features: dict[str, NumericSummary | CategoricalSummary] = {}
    skipped = []
    for name in table.column_names:
        column = table.column(name)
        kind = column.type
        if pa.types.is_dictionary(kind):
            column = column.cast(kind.value_type)
            kind = kind.value_type
        numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind)
        text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
        if numeric and name not in as_categories:
            values = column.cast(pa.float64()).to_numpy(zero_copy_only=False)
            features[name] = summarise_numeric(values, bins)
        elif numeric or text or pa.types.is_boolean(kind):
            features[name] = summarise_categorical(column.to_pylist(), max_categories)
        else:
            skipped.append(name)
    if not features:
        raise NoReference(f"{path}: no column of numbers, text or booleans")
    reference = Reference(
        model=model,
        version=version,
        source=str(path),
        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        rows=table.num_rows,
        features=features,
    )
    return reference, skipped


def save_reference(state_dir: str | Path, reference: Reference) -> Path:
    """Keep `reference` as the model's (version's), replacing one set before."""
    private_dir(references_dir(state_dir))
    path = reference_path(state_dir, reference.model, reference.version)
    atomic_write_text(path, reference.model_dump_json(indent=1) + "\n")
    return path


def read_reference(path: Path) -> Reference:
    try:
        return Reference.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise NoReference(f"no reference at {path}") from None
    except (OSError, ValidationError, ValueError) as exc:
        raise NoReference(f"{path}: not a drift reference: {str(exc)[:200]}") from None


def find_reference(state_dir: str | Path, model: str, version: str | None = None) -> Reference:
    """The version's reference where it has one, else the model's; NoReference naming how
    to set one."""
    candidates = [reference_path(state_dir, model, version)] if version else []
    candidates.append(reference_path(state_dir, model))
    for path in candidates:
        if path.is_file():
            return read_reference(path)
    how = f"servemesh drift {model} --set-reference FILE.parquet"
    raise NoReference(
        f"model {model!r}{f' version {version!r}' if version else ''} has no drift reference: "
        f"set one with `{how}`, or give --reference FILE.parquet"
    )


def all_references(state_dir: str | Path) -> list[Reference]:
    """Every reference kept (the model's and each version's), by file name; unreadable
    files left out."""
    folder = references_dir(state_dir)
    found = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            found.append(read_reference(path))
        except NoReference:
            continue  # being replaced, or not ours
    return found


def remove_reference(state_dir: str | Path, model: str, version: str | None = None) -> bool:
    path = reference_path(state_dir, model, version)
    existed = path.is_file()
    path.unlink(missing_ok=True)
    return existed


def drift_report(
    log: FeatureLog,
    reference: Reference,
    settings: DriftSpec,
    *,
    model: str,
    version: str | None = None,
    window_s: float | None = None,
) -> DriftReport:
    """`model`'s (`version`'s) calls of the last `window_s` (the spec's window without one)
    against `reference`: at most `settings.max_records` calls, newest first."""
    window = settings.window_s if window_s is None else window_s
    records = log.feature_records(model, version, window, settings.max_records)
    values = gather(records.values)
    return DriftReport(
        model=model,
        version=version,
        window_s=window,
        reference=reference,
        calls=records.calls,
        with_values=records.with_values,
        read=len(records.values),
        features=compare(reference, values, settings),
    )
