"""Checks on every name and field a caller sends; each failure names the field."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from servemesh.contract.echo import shown
from servemesh.contract.wire import OIP_DATATYPES
from servemesh.registry.errors import InvalidArgumentError
from servemesh.registry.records import TensorSpec, UploadHeader

# Model, version and alias names double as path-safe identifiers in logs and URLs.
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:/-]{0,63}")
LABEL_KEY = re.compile(r"[a-z0-9][a-z0-9._/-]{0,62}")
# Lineage values are references, not prose: no whitespace or control characters.
LINEAGE_VALUE = re.compile(r"[\x21-\x7e]{1,256}")
# Lineage keys with a known meaning, and the form their value must take.
LINEAGE_FORMS = {
    "data": (re.compile(r"sha256:[0-9a-f]{64}"), "sha256:<64 lowercase hex>"),
    "code": (re.compile(r"[0-9a-f]{7,64}"), "a git commit (7-64 lowercase hex)"),
}

# What the model servers load (services/model/artifacts.py): TorchScript archives,
# torch.export archives that pass the model server's allowlist before torch parses them,
# and ONNX models that pass its graph checks before onnxruntime loads them.
FORMATS = frozenset({"torchscript", "torch_export", "onnx"})
# OIP v2 tensor datatypes.
DATATYPES = OIP_DATATYPES

MAX_DESCRIPTION_CHARS = 1024
MAX_TENSORS = 256
MAX_DIMS = 16
MAX_LABELS = 64
MAX_LABEL_VALUE_CHARS = 256
MAX_LINEAGE = 32
MAX_METRICS = 64


# The value quoted for an error message, bounded so a caller cannot flood the logs.
_shown = shown


def check_name(value: str, field: str) -> str:
    """The name itself when it is a valid model, version or alias name."""
    if not value:
        raise InvalidArgumentError(f"{field}: required")
    if not NAME.fullmatch(value):
        raise InvalidArgumentError(
            f"{field}: {_shown(value)} is not a valid name (1-63 of a-z 0-9 . _ -, "
            "starting with a letter or digit)"
        )
    return value


def check_sha256(value: str, field: str) -> str:
    if not SHA256_HEX.fullmatch(value):
        raise InvalidArgumentError(f"{field}: must be 64 lowercase hex characters")
    return value


def check_description(value: str, field: str) -> str:
    if len(value) > MAX_DESCRIPTION_CHARS:
        raise InvalidArgumentError(f"{field}: longer than {MAX_DESCRIPTION_CHARS} characters")
    return value


def check_tensor_specs(specs: Sequence[TensorSpec], field: str) -> None:
    if not specs:
        raise InvalidArgumentError(f"{field}: at least one tensor is required")
    if len(specs) > MAX_TENSORS:
        raise InvalidArgumentError(f"{field}: more than {MAX_TENSORS} tensors")
    seen: set[str] = set()
    for index, spec in enumerate(specs):
        where = f"{field}[{index}]"
        if not TENSOR_NAME.fullmatch(spec.name):
            raise InvalidArgumentError(
                f"{where}.name: {_shown(spec.name)} is not a valid tensor name "
                "(1-64 of A-Z a-z 0-9 _ . : / -)"
            )
        if spec.name in seen:
            raise InvalidArgumentError(f"{where}.name: {spec.name!r} appears twice")
        seen.add(spec.name)
        if spec.datatype not in DATATYPES:
            raise InvalidArgumentError(
                f"{where}.datatype: {_shown(spec.datatype)} is not an OIP v2 datatype; "
                f"known: {', '.join(sorted(DATATYPES))}"
            )
        if len(spec.shape) > MAX_DIMS:
            raise InvalidArgumentError(f"{where}.shape: more than {MAX_DIMS} dimensions")
        for dim in spec.shape:
            if dim != -1 and dim < 1:
                raise InvalidArgumentError(
                    f"{where}.shape: dimension {dim} must be positive or -1 (variable)"
                )


def check_labels(labels: Mapping[str, str], field: str) -> None:
    if len(labels) > MAX_LABELS:
        raise InvalidArgumentError(f"{field}: more than {MAX_LABELS} labels")
    for key, value in labels.items():
        if not LABEL_KEY.fullmatch(key):
            raise InvalidArgumentError(
                f"{field}: key {_shown(key)} is not a valid label key (1-63 of a-z 0-9 . _ / -)"
            )
        if len(value) > MAX_LABEL_VALUE_CHARS:
            raise InvalidArgumentError(
                f"{field}[{key}]: value longer than {MAX_LABEL_VALUE_CHARS} characters"
            )


def check_lineage(lineage: Mapping[str, str], field: str) -> None:
    """Keys as label keys; values references without spaces; `data` and `code` in form."""
    if len(lineage) > MAX_LINEAGE:
        raise InvalidArgumentError(f"{field}: more than {MAX_LINEAGE} entries")
    for key, value in lineage.items():
        if not LABEL_KEY.fullmatch(key):
            raise InvalidArgumentError(
                f"{field}: key {_shown(key)} is not a valid key (1-63 of a-z 0-9 . _ / -)"
            )
        if not LINEAGE_VALUE.fullmatch(value):
            raise InvalidArgumentError(
                f"{field}[{key}]: {_shown(value)} is not a reference (1-256 printable "
                "characters, no spaces)"
            )
        form = LINEAGE_FORMS.get(key)
        if form is not None and not form[0].fullmatch(value):
            raise InvalidArgumentError(f"{field}[{key}]: {_shown(value)} is not {form[1]}")


def check_metrics(metrics: Mapping[str, float], field: str) -> None:
    """Keys as label keys; values finite numbers."""
    if len(metrics) > MAX_METRICS:
        raise InvalidArgumentError(f"{field}: more than {MAX_METRICS} metrics")
    for key, value in metrics.items():
        if not LABEL_KEY.fullmatch(key):
            raise InvalidArgumentError(
                f"{field}: key {_shown(key)} is not a valid metric name (1-63 of a-z 0-9 . _ / -)"
            )
        if not math.isfinite(value):
            raise InvalidArgumentError(f"{field}[{key}]: {value} is not a finite number")


def check_header(header: UploadHeader, field: str = "header") -> None:
    """Every field of an upload header; the artifact size limit is the store's to check."""
    check_name(header.model, f"{field}.model")
    check_name(header.version, f"{field}.version")
    check_sha256(header.sha256, f"{field}.sha256")
    if header.size_bytes <= 0:
        raise InvalidArgumentError(f"{field}.size_bytes: must be positive, got {header.size_bytes}")
    if header.format not in FORMATS:
        raise InvalidArgumentError(
            f"{field}.format: {_shown(header.format)} is not accepted; must be one of "
            f"{sorted(FORMATS)}"
        )
    check_tensor_specs(header.inputs, f"{field}.inputs")
    check_tensor_specs(header.outputs, f"{field}.outputs")
    check_labels(header.labels, f"{field}.labels")
    check_lineage(header.lineage, f"{field}.lineage")
    check_metrics(header.metrics, f"{field}.metrics")
