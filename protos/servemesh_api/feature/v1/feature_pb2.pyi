from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetFeaturesRequest(_message.Message):
    __slots__ = ("view", "entity_ids", "feature_names")
    VIEW_FIELD_NUMBER: _ClassVar[int]
    ENTITY_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_NAMES_FIELD_NUMBER: _ClassVar[int]
    view: str
    entity_ids: _containers.RepeatedScalarFieldContainer[str]
    feature_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, view: _Optional[str] = ..., entity_ids: _Optional[_Iterable[str]] = ..., feature_names: _Optional[_Iterable[str]] = ...) -> None: ...

class FeatureVector(_message.Message):
    __slots__ = ("entity_id", "values", "defaulted")
    ENTITY_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DEFAULTED_FIELD_NUMBER: _ClassVar[int]
    entity_id: str
    values: _containers.RepeatedScalarFieldContainer[float]
    defaulted: bool
    def __init__(self, entity_id: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ..., defaulted: _Optional[bool] = ...) -> None: ...

class GetFeaturesResponse(_message.Message):
    __slots__ = ("vectors",)
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    vectors: _containers.RepeatedCompositeFieldContainer[FeatureVector]
    def __init__(self, vectors: _Optional[_Iterable[_Union[FeatureVector, _Mapping]]] = ...) -> None: ...

class EntityFeatures(_message.Message):
    __slots__ = ("entity_id", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ENTITY_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    entity_id: str
    values: _containers.ScalarMap[str, float]
    def __init__(self, entity_id: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class WriteFeaturesRequest(_message.Message):
    __slots__ = ("view", "entities")
    VIEW_FIELD_NUMBER: _ClassVar[int]
    ENTITIES_FIELD_NUMBER: _ClassVar[int]
    view: str
    entities: _containers.RepeatedCompositeFieldContainer[EntityFeatures]
    def __init__(self, view: _Optional[str] = ..., entities: _Optional[_Iterable[_Union[EntityFeatures, _Mapping]]] = ...) -> None: ...

class WriteFeaturesResponse(_message.Message):
    __slots__ = ("written",)
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    written: int
    def __init__(self, written: _Optional[int] = ...) -> None: ...
