from google.api import annotations_pb2 as _annotations_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_ONLINE: _ClassVar[Tier]
    TIER_CACHE: _ClassVar[Tier]
    TIER_PRECOMPUTED: _ClassVar[Tier]
TIER_ONLINE: Tier
TIER_CACHE: Tier
TIER_PRECOMPUTED: Tier

class Tensor(_message.Message):
    __slots__ = ("datatype", "shape", "float_values", "double_values", "int64_values", "int_values", "uint64_values", "uint_values", "bool_values")
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUES_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_VALUES_FIELD_NUMBER: _ClassVar[int]
    INT64_VALUES_FIELD_NUMBER: _ClassVar[int]
    INT_VALUES_FIELD_NUMBER: _ClassVar[int]
    UINT64_VALUES_FIELD_NUMBER: _ClassVar[int]
    UINT_VALUES_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUES_FIELD_NUMBER: _ClassVar[int]
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    float_values: _containers.RepeatedScalarFieldContainer[float]
    double_values: _containers.RepeatedScalarFieldContainer[float]
    int64_values: _containers.RepeatedScalarFieldContainer[int]
    int_values: _containers.RepeatedScalarFieldContainer[int]
    uint64_values: _containers.RepeatedScalarFieldContainer[int]
    uint_values: _containers.RepeatedScalarFieldContainer[int]
    bool_values: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., float_values: _Optional[_Iterable[float]] = ..., double_values: _Optional[_Iterable[float]] = ..., int64_values: _Optional[_Iterable[int]] = ..., int_values: _Optional[_Iterable[int]] = ..., uint64_values: _Optional[_Iterable[int]] = ..., uint_values: _Optional[_Iterable[int]] = ..., bool_values: _Optional[_Iterable[bool]] = ...) -> None: ...

class EntityRow(_message.Message):
    __slots__ = ("ids",)
    class IdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.ScalarMap[str, str]
    def __init__(self, ids: _Optional[_Mapping[str, str]] = ...) -> None: ...

class FeatureRow(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("model", "entity_ids", "rows", "version", "entities", "inputs")
    class InputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENTITY_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENTITIES_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    entity_ids: _containers.RepeatedScalarFieldContainer[str]
    rows: _containers.RepeatedCompositeFieldContainer[FeatureRow]
    version: str
    entities: _containers.RepeatedCompositeFieldContainer[EntityRow]
    inputs: _containers.MessageMap[str, Tensor]
    def __init__(self, model: _Optional[str] = ..., entity_ids: _Optional[_Iterable[str]] = ..., rows: _Optional[_Iterable[_Union[FeatureRow, _Mapping]]] = ..., version: _Optional[str] = ..., entities: _Optional[_Iterable[_Union[EntityRow, _Mapping]]] = ..., inputs: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("scores", "model_version", "degraded", "request_id", "degraded_reason", "model_replica", "model_zone", "outputs", "tier")
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    SCORES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_REPLICA_FIELD_NUMBER: _ClassVar[int]
    MODEL_ZONE_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    model_version: str
    degraded: bool
    request_id: str
    degraded_reason: str
    model_replica: str
    model_zone: str
    outputs: _containers.MessageMap[str, Tensor]
    tier: Tier
    def __init__(self, scores: _Optional[_Iterable[float]] = ..., model_version: _Optional[str] = ..., degraded: _Optional[bool] = ..., request_id: _Optional[str] = ..., degraded_reason: _Optional[str] = ..., model_replica: _Optional[str] = ..., model_zone: _Optional[str] = ..., outputs: _Optional[_Mapping[str, Tensor]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...
