"""What the registry stores: models, their immutable versions, and upload headers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a model's signature, in OIP v2 terms (-1 marks a variable dimension)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TensorSpec:
        return cls(name=data["name"], datatype=data["datatype"], shape=tuple(data["shape"]))


@dataclass(frozen=True)
class UploadHeader:
    """What an uploader declares before the first byte: the bytes must then match it."""

    model: str
    version: str
    sha256: str
    size_bytes: int
    format: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    labels: Mapping[str, str] = field(default_factory=dict)
    # Where the version came from ("data" -> "sha256:<hex>", "code" -> a git commit).
    lineage: Mapping[str, str] = field(default_factory=dict)
    # Offline evaluation results ("auc" -> 0.91).
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class VersionRecord:
    """An immutable, verified model version; its artifact lives at its sha256 on disk."""

    model: str
    version: str
    sha256: str
    size_bytes: int
    format: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    labels: Mapping[str, str]
    created_unix_ms: int
    lineage: Mapping[str, str] = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelRecord:
    """A model and where its aliases point (alias -> version)."""

    name: str
    description: str
    aliases: Mapping[str, str]
    created_unix_ms: int
