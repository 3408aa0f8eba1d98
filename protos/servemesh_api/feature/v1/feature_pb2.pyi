from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RowLabel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROW_LABEL_ROW: _ClassVar[RowLabel]
    ROW_LABEL_LINE: _ClassVar[RowLabel]
ROW_LABEL_ROW: RowLabel
ROW_LABEL_LINE: RowLabel

class WatchChangesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Changes(_message.Message):
    __slots__ = ("ready", "heartbeat_ms", "changes")
    READY_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    heartbeat_ms: int
    changes: _containers.RepeatedCompositeFieldContainer[Change]
    def __init__(self, ready: _Optional[bool] = ..., heartbeat_ms: _Optional[int] = ..., changes: _Optional[_Iterable[_Union[Change, _Mapping]]] = ...) -> None: ...

class Change(_message.Message):
    __slots__ = ("row", "view", "model")
    ROW_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    row: RowChange
    view: str
    model: str
    def __init__(self, row: _Optional[_Union[RowChange, _Mapping]] = ..., view: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class RowChange(_message.Message):
    __slots__ = ("view", "entity_id")
    VIEW_FIELD_NUMBER: _ClassVar[int]
    ENTITY_ID_FIELD_NUMBER: _ClassVar[int]
    view: str
    entity_id: str
    def __init__(self, view: _Optional[str] = ..., entity_id: _Optional[str] = ...) -> None: ...

class GetFeaturesRequest(_message.Message):
    __slots__ = ("view", "entity_ids", "feature_names", "packed", "tier")
    VIEW_FIELD_NUMBER: _ClassVar[int]
    ENTITY_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_NAMES_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    view: str
    entity_ids: _containers.RepeatedScalarFieldContainer[str]
    feature_names: _containers.RepeatedScalarFieldContainer[str]
    packed: bool
    tier: TierAsk
    def __init__(self, view: _Optional[str] = ..., entity_ids: _Optional[_Iterable[str]] = ..., feature_names: _Optional[_Iterable[str]] = ..., packed: _Optional[bool] = ..., tier: _Optional[_Union[TierAsk, _Mapping]] = ...) -> None: ...

class TierAsk(_message.Message):
    __slots__ = ("model", "version", "precomputed")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PRECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    precomputed: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., precomputed: _Optional[bool] = ...) -> None: ...

class FeatureVector(_message.Message):
    __slots__ = ("entity_id", "values", "defaulted", "stale", "event_time_unix_ms")
    ENTITY_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DEFAULTED_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    entity_id: str
    values: _containers.RepeatedScalarFieldContainer[float]
    defaulted: bool
    stale: bool
    event_time_unix_ms: int
    def __init__(self, entity_id: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ..., defaulted: _Optional[bool] = ..., stale: _Optional[bool] = ..., event_time_unix_ms: _Optional[int] = ...) -> None: ...

class GetFeaturesResponse(_message.Message):
    __slots__ = ("vectors", "packed_values", "view_version", "tier")
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    PACKED_VALUES_FIELD_NUMBER: _ClassVar[int]
    VIEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    vectors: _containers.RepeatedCompositeFieldContainer[FeatureVector]
    packed_values: bytes
    view_version: int
    tier: GetTierAnswersResponse
    def __init__(self, vectors: _Optional[_Iterable[_Union[FeatureVector, _Mapping]]] = ..., packed_values: _Optional[bytes] = ..., view_version: _Optional[int] = ..., tier: _Optional[_Union[GetTierAnswersResponse, _Mapping]] = ...) -> None: ...

class EntityFeatures(_message.Message):
    __slots__ = ("entity_id", "values", "event_time_unix_ms")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ENTITY_ID_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    entity_id: str
    values: _containers.ScalarMap[str, float]
    event_time_unix_ms: int
    def __init__(self, entity_id: _Optional[str] = ..., values: _Optional[_Mapping[str, float]] = ..., event_time_unix_ms: _Optional[int] = ...) -> None: ...

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

class LoadHeader(_message.Message):
    __slots__ = ("view", "feature_names", "source", "row_label")
    VIEW_FIELD_NUMBER: _ClassVar[int]
    FEATURE_NAMES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ROW_LABEL_FIELD_NUMBER: _ClassVar[int]
    view: str
    feature_names: _containers.RepeatedScalarFieldContainer[str]
    source: str
    row_label: RowLabel
    def __init__(self, view: _Optional[str] = ..., feature_names: _Optional[_Iterable[str]] = ..., source: _Optional[str] = ..., row_label: _Optional[_Union[RowLabel, str]] = ...) -> None: ...

class LoadChunk(_message.Message):
    __slots__ = ("entity_ids", "values", "event_times_unix_ms", "first_row")
    ENTITY_IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIMES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_ROW_FIELD_NUMBER: _ClassVar[int]
    entity_ids: _containers.RepeatedScalarFieldContainer[str]
    values: bytes
    event_times_unix_ms: _containers.RepeatedScalarFieldContainer[int]
    first_row: int
    def __init__(self, entity_ids: _Optional[_Iterable[str]] = ..., values: _Optional[bytes] = ..., event_times_unix_ms: _Optional[_Iterable[int]] = ..., first_row: _Optional[int] = ...) -> None: ...

class LoadCommit(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class LoadFeaturesRequest(_message.Message):
    __slots__ = ("header", "chunk", "commit")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    header: LoadHeader
    chunk: LoadChunk
    commit: LoadCommit
    def __init__(self, header: _Optional[_Union[LoadHeader, _Mapping]] = ..., chunk: _Optional[_Union[LoadChunk, _Mapping]] = ..., commit: _Optional[_Union[LoadCommit, _Mapping]] = ...) -> None: ...

class LoadFeaturesResponse(_message.Message):
    __slots__ = ("view", "version", "rows", "entities", "replaced_version", "deleted_keys", "replicas_acknowledged")
    VIEW_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ENTITIES_FIELD_NUMBER: _ClassVar[int]
    REPLACED_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELETED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    view: str
    version: int
    rows: int
    entities: int
    replaced_version: int
    deleted_keys: int
    replicas_acknowledged: int
    def __init__(self, view: _Optional[str] = ..., version: _Optional[int] = ..., rows: _Optional[int] = ..., entities: _Optional[int] = ..., replaced_version: _Optional[int] = ..., deleted_keys: _Optional[int] = ..., replicas_acknowledged: _Optional[int] = ...) -> None: ...

class GetTierAnswersRequest(_message.Message):
    __slots__ = ("model", "version", "entity_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENTITY_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    entity_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., entity_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetTierAnswersResponse(_message.Message):
    __slots__ = ("flush_generation", "run", "sha256", "scored_at_unix_ms", "answers")
    FLUSH_GENERATION_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SCORED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    flush_generation: int
    run: int
    sha256: str
    scored_at_unix_ms: int
    answers: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, flush_generation: _Optional[int] = ..., run: _Optional[int] = ..., sha256: _Optional[str] = ..., scored_at_unix_ms: _Optional[int] = ..., answers: _Optional[_Iterable[bytes]] = ...) -> None: ...
