"""What the campaign sends: hypothesis strategies for each RPC's request messages.

Structured requests are valid-ish messages with boundary values (empty, huge, NaN and
infinities, negative and huge shapes, wrong datatypes, unknown names, long and deep
strings, maps with many keys); raw requests are random bytes sent as the method's
protobuf body. Every strategy yields the serialized messages of one call: one for a unary
call, zero or more for a client stream.

Control calls never name what the mesh serves (its models, its feature views' committed
data, its demo entities): a fuzzed unload of the served model would be the control
credential's business, not the input handling's, and would fail the valid trickle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from google.protobuf.message import Message
from hypothesis import strategies as st

from servemesh.contract.wire import LOAD_CONFIG_PARAMETER, LOAD_VERSION_PARAMETER
from servemesh.fuzz.rpcs import Rpc
from servemesh_api.feature.v1 import feature_pb2
from servemesh_api.gateway.v1 import gateway_pb2
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.registry.v1 import registry_pb2

# Below the services' message limit, so a huge request tests their handling, not gRPC's.
HUGE_COUNT = 200_000
LONG_STRING = 70_000
MANY_KEYS = 5_000
# Entity ids a control write may use: they never collide with the demo's `user-N`.
WRITE_ENTITY_PREFIX = "fuzz-"


@dataclass(frozen=True)
class Known:
    """Names the running mesh serves, so generated requests reach past the lookups."""

    models: dict[str, list[str]] = field(default_factory=dict)  # model -> versions
    views: dict[str, list[str]] = field(default_factory=dict)  # view -> features
    entities: list[str] = field(default_factory=list)
    inputs: dict[str, str] = field(default_factory=dict)  # a model input -> its datatype

    @property
    def model_names(self) -> list[str]:
        return sorted(self.models) or ["fraud"]

    @property
    def versions(self) -> list[str]:
        return sorted({v for vs in self.models.values() for v in vs}) or ["v1"]


DATATYPES = ["FP32", "FP64", "FP16", "BF16", "INT64", "INT32", "INT8", "UINT8", "UINT64"]
DATATYPES += ["BOOL", "BYTES", "", "fp32", "float", "TYPE_FP32", "FP32 ", "\x00"]

odd_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", " ", "\x00", "..", "../../etc/passwd", "%s%n", "{}", "null"]),
    st.sampled_from(["a" * LONG_STRING, "/" * 4096, "../" * 2000, "é" * 20_000]),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=100, max_size=400),
)
# A float32 field silently rounds doubles: keep them representable, plus the edges.
floats32 = st.one_of(
    st.floats(width=32),
    st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, 3.4e38, -3.4e38, 1e-45]),
)
floats64 = st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, 1.8e308]))
INT64_EDGES = [0, 1, -1, 2, 64, 1024, 2**31 - 1, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63)]
int64s = st.one_of(st.sampled_from(INT64_EDGES), st.integers(-(2**63), 2**63 - 1))
shapes = st.one_of(
    st.lists(int64s, max_size=6),
    st.sampled_from([[], [0], [0, 64], [1, 64], [-1, 64], [2**62, 2**62], [1] * 64]),
)


def values_of(element: st.SearchStrategy[object]) -> st.SearchStrategy[list[object]]:
    """A value list: short and arbitrary, or one huge run of one element."""
    huge = st.tuples(element, st.sampled_from([HUGE_COUNT, 64 * 1024])).map(lambda t: [t[0]] * t[1])
    return st.one_of(st.lists(element, max_size=130), huge)


def names(known: Sequence[str], *, allow_known: bool = True) -> st.SearchStrategy[str]:
    """A name: often one the mesh serves (when allowed), else anything."""
    if allow_known and known:
        return st.one_of(st.sampled_from(list(known)), odd_text)
    return odd_text.filter(lambda s: s not in known)


def string_maps(key: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, str]]:
    many = st.integers(1, MANY_KEYS).map(lambda n: {f"k{i}": "v" for i in range(n)})
    return st.one_of(st.dictionaries(key, odd_text, max_size=8), many)


def _serialize(*messages: Message) -> list[bytes]:
    return [m.SerializeToString() for m in messages]


# --- gateway -----------------------------------------------------------------------------


@st.composite
def public_tensor(draw: st.DrawFn, known: Known) -> gateway_pb2.Tensor:
    tensor = gateway_pb2.Tensor(datatype=draw(st.sampled_from(DATATYPES)), shape=draw(shapes))
    field_name, element = draw(
        st.sampled_from(
            [
                ("float_values", floats32),
                ("double_values", floats64),
                ("int64_values", int64s),
                ("int_values", st.integers(-(2**31), 2**31 - 1)),
                ("uint64_values", st.integers(0, 2**64 - 1)),
                ("uint_values", st.integers(0, 2**32 - 1)),
                ("bool_values", st.booleans()),
            ]
        )
    )
    getattr(tensor, field_name).extend(draw(values_of(element)))
    return tensor


@st.composite
def near_valid_predict(draw: st.DrawFn, known: Known) -> list[bytes]:
    """A Predict that passes the name checks, with at most one odd part: these reach the
    feature lookups, the tensor conversion and the model server behind them."""
    entities = known.entities or ["user-1"]
    request = gateway_pb2.PredictRequest(
        model=draw(st.sampled_from(known.model_names)),
        version=draw(st.sampled_from(["", *known.versions])),
    )
    request.entity_ids.extend(draw(st.lists(st.sampled_from(entities), min_size=1, max_size=8)))
    width = len(next(iter(known.views.values()), [])) or 64
    odd = draw(st.sampled_from(["none", "rows", "entity", "count", "inputs", "both"]))
    if odd == "rows":
        del request.entity_ids[:]
        for _ in range(draw(st.integers(1, 4))):
            values = draw(st.lists(floats32, min_size=width, max_size=width))
            request.rows.add().values.extend(values)
    elif odd == "entity":
        request.entity_ids.append(draw(odd_text))
    elif odd == "count":
        request.entity_ids.extend(entities[:1] * draw(st.sampled_from([1023, 1024, 1025, 5000])))
    elif odd == "inputs":
        request.inputs[draw(names(sorted(known.inputs)))].CopyFrom(draw(public_tensor(known)))
    elif odd == "both":
        request.entities.add().ids.update({next(iter(known.views), "user"): entities[0]})
    return _serialize(request)


@st.composite
def predict(draw: st.DrawFn, known: Known) -> list[bytes]:
    request = gateway_pb2.PredictRequest(
        model=draw(names(known.model_names)),
        version=draw(st.one_of(st.just(""), names(known.versions))),
    )
    entity = names(known.entities)
    request.entity_ids.extend(draw(st.lists(entity, max_size=6)))
    if draw(st.booleans()):
        request.entity_ids.extend([known.entities[0] if known.entities else "e"] * 5000)
    for _ in range(draw(st.integers(0, 3))):
        request.rows.add().values.extend(draw(values_of(floats32)))
    for _ in range(draw(st.integers(0, 2))):
        views = names(sorted(known.views))
        request.entities.add().ids.update(draw(st.dictionaries(views, entity, max_size=4)))
    for _ in range(draw(st.integers(0, 2))):
        request.inputs[draw(names(sorted(known.inputs)))].CopyFrom(draw(public_tensor(known)))
    return _serialize(request)


# --- model server (OIP) --------------------------------------------------------------------

infer_parameter = st.one_of(
    st.builds(lambda b: oip.InferParameter(bool_param=b), st.booleans()),
    st.builds(lambda i: oip.InferParameter(int64_param=i), int64s),
    st.builds(lambda s: oip.InferParameter(string_param=s), odd_text),
    st.builds(lambda d: oip.InferParameter(double_param=d), floats64),
    st.builds(lambda u: oip.InferParameter(uint64_param=u), st.integers(0, 2**64 - 1)),
)
PARAMETER_NAMES = ["priority", "timeout", "sequence_id", "binary_data_output", "x"]


@st.composite
def infer_parameters(draw: st.DrawFn) -> dict[str, oip.InferParameter]:
    keys = st.one_of(st.sampled_from(PARAMETER_NAMES), odd_text)
    out = draw(st.dictionaries(keys, infer_parameter, max_size=5))
    if draw(st.integers(0, 9)) == 0:
        out.update({f"p{i}": oip.InferParameter(bool_param=True) for i in range(MANY_KEYS)})
    return out


@st.composite
def infer_input(draw: st.DrawFn, known: Known) -> oip.ModelInferRequest.InferInputTensor:
    name = draw(names(sorted(known.inputs)))
    datatype = draw(st.one_of(st.sampled_from(DATATYPES), st.just(known.inputs.get(name, ""))))
    tensor = oip.ModelInferRequest.InferInputTensor(name=name, datatype=datatype)
    rows = draw(st.sampled_from([0, 1, 2, 64, 1025, -1]))
    tensor.shape.extend(draw(st.one_of(shapes, st.just([rows, 64]))))
    for key, value in draw(infer_parameters()).items():
        tensor.parameters[key].CopyFrom(value)
    field_name, element = draw(
        st.sampled_from(
            [
                ("fp32_contents", floats32),
                ("fp64_contents", floats64),
                ("int64_contents", int64s),
                ("int_contents", st.integers(-(2**31), 2**31 - 1)),
                ("bool_contents", st.booleans()),
                ("bytes_contents", st.binary(max_size=64)),
                ("uint_contents", st.integers(0, 2**32 - 1)),
            ]
        )
    )
    if draw(st.booleans()):
        if field_name == "fp32_contents" and rows > 0 and draw(st.booleans()):
            # The right number of values, so the request gets past the shape checks.
            getattr(tensor.contents, field_name).extend([draw(floats32)] * (rows * 64))
        else:
            getattr(tensor.contents, field_name).extend(draw(values_of(element)))
    return tensor


@st.composite
def near_valid_model_infer(draw: st.DrawFn, known: Known) -> list[bytes]:
    """A ModelInfer for a served model and its input, right in all but (maybe) one part:
    the values, the shape, the datatype, a parameter, or raw contents for typed ones."""
    name, datatype = draw(st.sampled_from(sorted(known.inputs.items()) or [("x", "FP32")]))
    width = len(next(iter(known.views.values()), [])) or 64
    rows = draw(st.sampled_from([1, 2, 7, 64, 1024, 1025]))
    request = oip.ModelInferRequest(
        model_name=draw(st.sampled_from(known.model_names)),
        model_version=draw(st.sampled_from(["", *known.versions])),
    )
    tensor = request.inputs.add(name=name, datatype=datatype, shape=[rows, width])
    value = draw(floats32)
    tensor.contents.fp32_contents.extend([value] * (rows * width))
    odd = draw(st.sampled_from(["none", "shape", "datatype", "short", "raw", "param", "output"]))
    if odd == "shape":
        del tensor.shape[:]
        tensor.shape.extend(draw(shapes))
    elif odd == "datatype":
        tensor.datatype = draw(st.sampled_from(DATATYPES))
    elif odd == "short":
        del tensor.contents.fp32_contents[-1:]
    elif odd == "raw":
        tensor.ClearField("contents")
        size = rows * width * 4 + draw(st.sampled_from([0, -1, 1, 4]))
        request.raw_input_contents.append(bytes(max(0, size)))
    elif odd == "param":
        request.parameters[draw(st.sampled_from(PARAMETER_NAMES))].CopyFrom(draw(infer_parameter))
    elif odd == "output":
        request.outputs.add(name=draw(odd_text))
    return _serialize(request)


@st.composite
def model_infer(draw: st.DrawFn, known: Known) -> list[bytes]:
    request = oip.ModelInferRequest(
        model_name=draw(names(known.model_names)),
        model_version=draw(st.one_of(st.just(""), names(known.versions))),
        id=draw(odd_text),
    )
    for key, value in draw(infer_parameters()).items():
        request.parameters[key].CopyFrom(value)
    request.inputs.extend(draw(st.lists(infer_input(known), max_size=3)))
    for _ in range(draw(st.integers(0, 2))):
        request.outputs.add(name=draw(odd_text))
    request.raw_input_contents.extend(draw(st.lists(st.binary(max_size=2048), max_size=3)))
    return _serialize(request)


@st.composite
def model_lookup(draw: st.DrawFn, known: Known, cls: type[Message]) -> list[bytes]:
    return _serialize(
        cls(
            name=draw(names(known.model_names)),
            version=draw(st.one_of(st.just(""), names(known.versions))),
        )
    )


repository_parameter = st.one_of(
    st.builds(lambda b: oip.ModelRepositoryParameter(bool_param=b), st.booleans()),
    st.builds(lambda i: oip.ModelRepositoryParameter(int64_param=i), int64s),
    st.builds(lambda s: oip.ModelRepositoryParameter(string_param=s), odd_text),
    st.builds(lambda b: oip.ModelRepositoryParameter(bytes_param=b), st.binary(max_size=256)),
)
load_config = st.one_of(
    odd_text,
    st.sampled_from(['{"versions": {}}', '{"versions": {"v1": {"source": "demo:1"}}}', "[]"]),
    st.sampled_from(['{"inputs": ' * 3000 + "1" + "}" * 3000, '{"a": 1e999}', "{" * 100_000]),
)


@st.composite
def repository_change(draw: st.DrawFn, known: Known, cls: type[Message]) -> list[bytes]:
    request = cls(
        repository_name=draw(odd_text),
        model_name=draw(names(known.model_names, allow_known=False)),
    )
    keys = st.one_of(st.sampled_from([LOAD_VERSION_PARAMETER, LOAD_CONFIG_PARAMETER]), odd_text)
    for key, value in draw(st.dictionaries(keys, repository_parameter, max_size=3)).items():
        request.parameters[key].CopyFrom(value)
    if draw(st.booleans()):
        request.parameters[LOAD_CONFIG_PARAMETER].string_param = draw(load_config)
    return _serialize(request)


# --- feature service --------------------------------------------------------------------------


@st.composite
def near_valid_get_features(draw: st.DrawFn, known: Known) -> list[bytes]:
    view, features = draw(st.sampled_from(sorted(known.views.items()) or [("user", ["f00"])]))
    request = feature_pb2.GetFeaturesRequest(view=view)
    request.entity_ids.extend(
        draw(st.lists(st.sampled_from(known.entities or ["user-1"]), min_size=1, max_size=8))
    )
    request.feature_names.extend(draw(st.lists(st.sampled_from(features), max_size=70)))
    odd = draw(st.sampled_from(["none", "feature", "entity", "many"]))
    if odd == "feature":
        request.feature_names.append(draw(odd_text))
    elif odd == "entity":
        request.entity_ids.append(draw(odd_text))
    elif odd == "many":
        request.entity_ids.extend(request.entity_ids[:1] * draw(st.sampled_from([1000, 20_000])))
    return _serialize(request)


@st.composite
def get_features(draw: st.DrawFn, known: Known) -> list[bytes]:
    request = feature_pb2.GetFeaturesRequest(view=draw(names(sorted(known.views))))
    request.entity_ids.extend(draw(st.lists(names(known.entities), max_size=8)))
    if draw(st.integers(0, 4)) == 0:
        request.entity_ids.extend((known.entities[:1] or ["e"]) * (HUGE_COUNT // 10))
    features = sorted({f for fs in known.views.values() for f in fs})
    request.feature_names.extend(draw(st.lists(names(features), max_size=8)))
    return _serialize(request)


write_entity = odd_text.map(lambda s: WRITE_ENTITY_PREFIX + s[:200])


@st.composite
def write_features(draw: st.DrawFn, known: Known) -> list[bytes]:
    request = feature_pb2.WriteFeaturesRequest(view=draw(names(sorted(known.views))))
    features = sorted({f for fs in known.views.values() for f in fs})
    for _ in range(draw(st.integers(0, 4))):
        row = request.entities.add(entity_id=draw(write_entity), event_time_unix_ms=draw(int64s))
        row.values.update(draw(st.dictionaries(names(features), floats32, max_size=70)))
    return _serialize(request)


@st.composite
def load_features(draw: st.DrawFn, known: Known) -> list[bytes]:
    """A load stream on a view the mesh does not serve: a committed load replaces a view."""
    messages: list[Message] = []
    features = sorted({f for fs in known.views.values() for f in fs})
    if draw(st.integers(0, 4)):
        header = feature_pb2.LoadHeader(
            view=draw(names(sorted(known.views), allow_known=False)),
            source=draw(odd_text),
            # Open enums: values beyond the two the proto names reach the service too.
            row_label=cast(Any, draw(st.sampled_from([0, 1, 7, -1]))),
        )
        header.feature_names.extend(draw(st.lists(names(features), max_size=70)))
        messages.append(feature_pb2.LoadFeaturesRequest(header=header))
    for _ in range(draw(st.integers(0, 3))):
        chunk = feature_pb2.LoadChunk(first_row=draw(st.integers(0, 2**64 - 1)))
        chunk.entity_ids.extend(draw(st.lists(write_entity, max_size=5)))
        chunk.values = draw(st.binary(max_size=4096))
        chunk.event_times_unix_ms.extend(draw(st.lists(int64s, max_size=5)))
        messages.append(feature_pb2.LoadFeaturesRequest(chunk=chunk))
    if draw(st.booleans()):
        commit = feature_pb2.LoadCommit(rows=draw(st.integers(0, 2**64 - 1)))
        messages.append(feature_pb2.LoadFeaturesRequest(commit=commit))
    if draw(st.booleans()):
        draw(st.permutations(messages))
    return _serialize(*messages)


# --- registry ------------------------------------------------------------------------------

tensor_spec = st.builds(
    registry_pb2.TensorSpec, name=odd_text, datatype=st.sampled_from(DATATYPES), shape=shapes
)


@st.composite
def upload_version(draw: st.DrawFn, known: Known) -> list[bytes]:
    messages: list[Message] = []
    if draw(st.integers(0, 4)):
        header = registry_pb2.UploadHeader(
            model=draw(names(known.model_names, allow_known=False)),
            version=draw(odd_text),
            sha256=draw(st.one_of(odd_text, st.binary(min_size=32, max_size=32).map(bytes.hex))),
            size_bytes=draw(int64s),
            format=draw(st.sampled_from(["torchscript", "torch_export", "pickle", "", "x"])),
        )
        header.inputs.extend(draw(st.lists(tensor_spec, max_size=3)))
        header.outputs.extend(draw(st.lists(tensor_spec, max_size=3)))
        header.labels.update(draw(string_maps(odd_text)))
        header.lineage.update(draw(st.dictionaries(odd_text, odd_text, max_size=3)))
        header.metrics.update(draw(st.dictionaries(odd_text, floats64, max_size=3)))
        messages.append(registry_pb2.UploadVersionRequest(header=header))
    for chunk in draw(st.lists(st.binary(max_size=4096), max_size=3)):
        messages.append(registry_pb2.UploadVersionRequest(chunk=chunk))
    if draw(st.integers(0, 4)) == 0:
        messages.reverse()
    return _serialize(*messages)


@st.composite
def create_model(draw: st.DrawFn, known: Known) -> list[bytes]:
    name = draw(names(known.model_names, allow_known=False))
    return _serialize(registry_pb2.CreateModelRequest(name=name, description=draw(odd_text)))


@st.composite
def set_alias(draw: st.DrawFn, known: Known) -> list[bytes]:
    request = registry_pb2.SetAliasRequest(
        model=draw(names(known.model_names, allow_known=False)),
        alias=draw(odd_text),
        version=draw(names(known.versions)),
    )
    return _serialize(request)


@st.composite
def registry_lookup(draw: st.DrawFn, known: Known, cls: type[Message]) -> list[bytes]:
    fields = {f.name for f in cls.DESCRIPTOR.fields}
    values: dict[str, str] = {}
    if "model" in fields:
        values["model"] = draw(names(known.model_names))
    if "version" in fields:
        values["version"] = draw(names(known.versions))
    return _serialize(cls(**values))


def empty(known: Known, cls: type[Message]) -> st.SearchStrategy[list[bytes]]:
    return st.just(_serialize(cls()))


@st.composite
def repository_index(draw: st.DrawFn, known: Known) -> list[bytes]:
    return _serialize(
        oip.RepositoryIndexRequest(repository_name=draw(odd_text), ready=draw(st.booleans()))
    )


# --- raw -------------------------------------------------------------------------------------

raw_body = st.one_of(
    st.binary(max_size=512),
    st.sampled_from([b"", b"\x00" * 64, b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f"]),
    # A length-delimited field that claims more bytes than follow, and deep nesting.
    st.sampled_from([b"\x0a\x80\x80\x80\x80\x08abc", b"\x2a\x02" * 100 + b"\x0a\x00" * 2]),
)


def raw(rpc: Rpc) -> st.SearchStrategy[list[bytes]]:
    if rpc.shape == "client_stream":
        return st.lists(raw_body, max_size=4)
    return raw_body.map(lambda body: [body])


Structured = Callable[[Known], st.SearchStrategy[list[bytes]]]

NEAR_VALID: dict[str, Structured] = {
    "Predict": near_valid_predict,
    "ModelInfer": near_valid_model_infer,
    "GetFeatures": near_valid_get_features,
}


def near_valid(rpc: Rpc, known: Known) -> st.SearchStrategy[list[bytes]]:
    """Requests that pass the name checks (the data-plane calls with deep handling);
    other RPCs' structured requests."""
    build = NEAR_VALID.get(rpc.method)
    return build(known) if build is not None else structured(rpc, known)


def structured(rpc: Rpc, known: Known) -> st.SearchStrategy[list[bytes]]:
    table: dict[str, Structured] = {
        "Predict": predict,
        "ModelInfer": model_infer,
        "ModelReady": lambda k: model_lookup(k, oip.ModelReadyRequest),
        "ModelMetadata": lambda k: model_lookup(k, oip.ModelMetadataRequest),
        "ModelStatistics": lambda k: model_lookup(k, oip.ModelStatisticsRequest),
        "RepositoryIndex": repository_index,
        "RepositoryModelLoad": lambda k: repository_change(k, oip.RepositoryModelLoadRequest),
        "RepositoryModelUnload": lambda k: repository_change(k, oip.RepositoryModelUnloadRequest),
        "GetFeatures": get_features,
        "WriteFeatures": write_features,
        "LoadFeatures": load_features,
        "CreateModel": create_model,
        "UploadVersion": upload_version,
        "SetAlias": set_alias,
        "GetVersion": lambda k: registry_lookup(k, registry_pb2.GetVersionRequest),
        "ListVersions": lambda k: registry_lookup(k, registry_pb2.ListVersionsRequest),
        "DownloadArtifact": lambda k: registry_lookup(k, registry_pb2.DownloadArtifactRequest),
    }
    build = table.get(rpc.method)
    if build is None:  # requests without fields: ServerLive, ServerReady, ListModels...
        return empty(known, rpc.request)
    return build(known)
