"""Between the store's records and the registry.v1 protobuf messages."""

from __future__ import annotations

from servemesh.registry.records import ModelRecord, TensorSpec, UploadHeader, VersionRecord
from servemesh_api.registry.v1 import registry_pb2


def tensor_spec_to_proto(spec: TensorSpec) -> registry_pb2.TensorSpec:
    return registry_pb2.TensorSpec(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))


def tensor_spec_from_proto(message: registry_pb2.TensorSpec) -> TensorSpec:
    return TensorSpec(name=message.name, datatype=message.datatype, shape=tuple(message.shape))


def header_from_proto(
    message: registry_pb2.UploadHeader | registry_pb2.ModelVersion,
) -> UploadHeader:
    """What an upload declares: an uploader's header, or (a mirror copying a version) the
    registry's record of it, whose fields of the same names say the same."""
    return UploadHeader(
        model=message.model,
        version=message.version,
        sha256=message.sha256,
        size_bytes=message.size_bytes,
        format=message.format,
        inputs=tuple(tensor_spec_from_proto(spec) for spec in message.inputs),
        outputs=tuple(tensor_spec_from_proto(spec) for spec in message.outputs),
        labels=dict(message.labels),
        lineage=dict(message.lineage),
        metrics=dict(message.metrics),
    )


def version_to_proto(record: VersionRecord) -> registry_pb2.ModelVersion:
    return registry_pb2.ModelVersion(
        model=record.model,
        version=record.version,
        sha256=record.sha256,
        size_bytes=record.size_bytes,
        format=record.format,
        inputs=[tensor_spec_to_proto(spec) for spec in record.inputs],
        outputs=[tensor_spec_to_proto(spec) for spec in record.outputs],
        created_unix_ms=record.created_unix_ms,
        labels=dict(record.labels),
        lineage=dict(record.lineage),
        metrics=dict(record.metrics),
    )


def model_to_proto(record: ModelRecord) -> registry_pb2.Model:
    return registry_pb2.Model(
        name=record.name,
        description=record.description,
        aliases=dict(record.aliases),
        created_unix_ms=record.created_unix_ms,
    )
