from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FeatureRow(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("model", "entity_ids", "rows", "version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENTITY_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    entity_ids: _containers.RepeatedScalarFieldContainer[str]
    rows: _containers.RepeatedCompositeFieldContainer[FeatureRow]
    version: str
    def __init__(self, model: _Optional[str] = ..., entity_ids: _Optional[_Iterable[str]] = ..., rows: _Optional[_Iterable[_Union[FeatureRow, _Mapping]]] = ..., version: _Optional[str] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("scores", "model_version", "degraded", "request_id", "degraded_reason", "model_replica", "model_zone")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_REPLICA_FIELD_NUMBER: _ClassVar[int]
    MODEL_ZONE_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    model_version: str
    degraded: bool
    request_id: str
    degraded_reason: str
    model_replica: str
    model_zone: str
    def __init__(self, scores: _Optional[_Iterable[float]] = ..., model_version: _Optional[str] = ..., degraded: _Optional[bool] = ..., request_id: _Optional[str] = ..., degraded_reason: _Optional[str] = ..., model_replica: _Optional[str] = ..., model_zone: _Optional[str] = ...) -> None: ...
