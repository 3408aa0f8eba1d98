"""Loading a user's feature file into the online store: `servemesh features load`.

    FeatureFile        a CSV or Parquet file, read in record batches (never all at once)
    FeatureFile.layout which column is the key, which the event time, which the features
    load_file          stream the rows to a feature service's LoadFeatures, all or nothing
    LoadError          the load did not happen (nothing of it is in the store)
    └── BadFile        the file's problems, each naming its line (CSV) or row, and column
    FileError          the file cannot be read at all, or its columns do not fit the view

docs/features.md says how the rows reach Redis and when readers see them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servemesh.features._read import DEFAULT_BATCH_ROWS, FeatureFile, FileError, Layout
    from servemesh.features._send import (
        BadFile,
        LoadError,
        LoadSummary,
        feature_addresses,
        load_file,
    )

# Where each public name lives; imported on first use, so `servemesh` commands other than
# `features` never load pyarrow.
_HOMES = {
    "DEFAULT_BATCH_ROWS": "_read",
    "FeatureFile": "_read",
    "FileError": "_read",
    "Layout": "_read",
    "BadFile": "_send",
    "LoadError": "_send",
    "LoadSummary": "_send",
    "feature_addresses": "_send",
    "load_file": "_send",
}
__all__ = [
    "DEFAULT_BATCH_ROWS",
    "BadFile",
    "FeatureFile",
    "FileError",
    "Layout",
    "LoadError",
    "LoadSummary",
    "feature_addresses",
    "load_file",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
