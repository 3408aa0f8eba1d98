"""Models with several named inputs and outputs: validation, decoding, batching, serving.

The models are real torch modules (tests/model/torch_models.py); the server is a real
grpc.aio server on loopback.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable

import grpc
import numpy as np
import pytest
import torch

from servemesh.services.model.artifacts import Format
from servemesh.services.model.batching import Batcher, ManualClock, NamedRows, Rows, row_count
from servemesh.services.model.errors import InferenceFailed, LoadError
from servemesh.services.model.loader import LoadedModel, ModelLoader, load_model
from servemesh.services.model.runner import ModelRunner
from servemesh.services.model.service import InferenceServicer
from servemesh.services.model.tensors import (
    RequestError,
    Signature,
    TensorSig,
    decode_request,
    encode_outputs,
)
from servemesh.services.model.torch_types import to_array
from servemesh.spec import BatchingSpec
from servemesh_api.inference import grpc_service_pb2 as oip
from tests.model.model_helpers import Stub, serving
from tests.model.torch_models import (
    CHURN_FEATURES,
    CHURN_SIGNATURE,
    DTYPES_SIGNATURE,
    Churn,
    Dtypes,
    churn_example,
    churn_reference,
    dtypes_example,
    exported,
    scripted,
)

pytestmark = pytest.mark.timeout(120)

Request = oip.ModelInferRequest


def churn_rows(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(n, CHURN_FEATURES)).astype(np.float32)
    category = rng.integers(0, 5, size=n).astype(np.int64)
    return features, category


def churn_request(
    features: np.ndarray,
    category: np.ndarray,
    *,
    raw: bool = True,
    model: str = "churn",
    category_first: bool = False,
) -> Request:
    request = Request(model_name=model)
    tensors = [("features", "FP32", features), ("category", "INT64", category)]
    for name, datatype, array in reversed(tensors) if category_first else tensors:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if raw:
            request.raw_input_contents.append(array.tobytes())
        elif datatype == "FP32":
            tensor.contents.fp32_contents.extend(array.ravel().tolist())
        else:
            tensor.contents.int64_contents.extend(array.ravel().tolist())
    return request


def one_row_category(request: Request) -> None:
    request.inputs[1].shape[0] = 1
    request.raw_input_contents[1] = b"\0" * 8


def refused(request: Request, signature: Signature = CHURN_SIGNATURE) -> str:
    with pytest.raises(RequestError) as caught:
        decode_request(request, signature, 16)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.message


# --- validation and decoding -------------------------------------------------------------


def test_two_inputs_decode_to_named_rows_in_signature_order() -> None:
    features, category = churn_rows(3)
    request = churn_request(features, category, category_first=True)  # any order
    decoded = decode_request(request, CHURN_SIGNATURE, 16)
    assert isinstance(decoded.rows, NamedRows) and list(decoded.rows) == ["features", "category"]
    np.testing.assert_array_equal(decoded.rows["features"], features)
    np.testing.assert_array_equal(decoded.rows["category"], category)
    assert decoded.rows.n_rows == 3 and decoded.outputs == ("probabilities", "label")
    typed = decode_request(churn_request(features, category, raw=False), CHURN_SIGNATURE, 16)
    assert isinstance(typed.rows, NamedRows) and not typed.raw
    np.testing.assert_array_equal(typed.rows["category"], category)


def test_an_input_of_the_wrong_datatype_is_refused_naming_it() -> None:
    features, category = churn_rows(2)
    request = churn_request(features, category.astype(np.float32))
    request.inputs[1].datatype = "FP32"
    assert refused(request) == ("inputs[1].datatype: expected INT64 for input 'category', got FP32")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            one_row_category,
            "inputs[1].shape[0]: input 'category' has 1 rows but inputs[0] 'features' has 2",
        ),
        (
            lambda r: (r.inputs.pop(), r.raw_input_contents.pop()),
            "inputs: missing input 'category'",
        ),
        (
            lambda r: setattr(r.inputs[1], "name", "features"),
            "inputs[1].name: duplicate input 'features'",
        ),
        (
            lambda r: r.outputs.add(name="logits"),
            "outputs[0].name: unknown output 'logits'; the model gives ['probabilities', 'label']",
        ),
        (
            lambda r: r.raw_input_contents.pop(),
            "raw_input_contents: expected one buffer per input (2), got 1",
        ),
        (
            lambda r: r.raw_input_contents.__setitem__(1, b"\0" * 15),
            "raw_input_contents[1]: expected 16 bytes for shape [2] INT64, got 15",
        ),
        (
            lambda r: r.inputs[1].shape.__setitem__(0, 2**62),
            "inputs[1].shape[0]: 4611686018427387904 rows exceed the limit of 16 per request",
        ),
    ],
    ids=["row-counts", "missing", "duplicate", "unknown-output", "buffers", "bytes", "overflow"],
)
def test_every_input_is_checked_before_the_request_may_join_a_batch(
    change: Callable[[Request], object], message: str
) -> None:
    request = churn_request(*churn_rows(2))
    change(request)
    assert message in refused(request)


def test_bool_and_int32_decode_from_typed_contents_and_encode_back_typed() -> None:
    signature = Signature(
        inputs=[TensorSig("flags", "BOOL", (-1,)), TensorSig("counts", "INT32", (-1, 2))],
        outputs=[TensorSig("flags", "BOOL", (-1,)), TensorSig("counts", "INT32", (-1, 2))],
    )
    request = Request(model_name="typed")
    request.inputs.add(name="flags", datatype="BOOL", shape=[2]).contents.bool_contents.extend(
        [True, False]
    )
    counts = request.inputs.add(name="counts", datatype="INT32", shape=[2, 2])
    counts.contents.int_contents.extend([1, -2, 3, 2**31 - 1])
    decoded = decode_request(request, signature, 16)
    assert isinstance(decoded.rows, NamedRows)
    assert decoded.rows["flags"].tolist() == [True, False]
    assert decoded.rows["counts"].dtype == np.dtype("<i4")
    response = oip.ModelInferResponse()
    encode_outputs(response, decoded.rows, signature, decoded.outputs, decoded.raw)
    assert list(response.outputs[0].contents.bool_contents) == [True, False]
    assert list(response.outputs[1].contents.int_contents) == [1, -2, 3, 2**31 - 1]
    assert not response.raw_output_contents


def test_bf16_has_no_typed_field_and_travels_raw() -> None:
    request = Request(model_name="dtypes")
    tensor = request.inputs.add(name="brain", datatype="BF16", shape=[1, 3])
    tensor.contents.fp32_contents.extend([1.0, 2.0, 3.0])
    signature = Signature(
        TensorSig("brain", "BF16", (-1, 3)), TensorSig("brain_plus_one", "BF16", (-1, 3))
    )
    assert refused(request, signature) == (
        "inputs[0].contents: BF16 has no typed field; send raw_input_contents"
    )


def test_outputs_are_encoded_by_name_raw_or_typed_and_all_raw_when_one_has_no_typed_field() -> None:
    result = NamedRows(
        {
            "probabilities": np.array([[0.5, 0.25, 0.25]], np.float32),
            "label": np.array([0], np.int64),
        }
    )
    typed = oip.ModelInferResponse()
    encode_outputs(typed, result, CHURN_SIGNATURE, ("label", "probabilities"), raw=False)
    assert [(o.name, o.datatype, list(o.shape)) for o in typed.outputs] == [
        ("label", "INT64", [1]),
        ("probabilities", "FP32", [1, 3]),
    ]
    assert list(typed.outputs[0].contents.int64_contents) == [0]
    assert not typed.raw_output_contents
    raw = oip.ModelInferResponse()
    encode_outputs(raw, result, CHURN_SIGNATURE, ("probabilities", "label"), raw=True)
    assert np.frombuffer(raw.raw_output_contents[1], "<i8").tolist() == [0]
    # FP16 has no typed field: OIP wants raw contents for every output or none.
    halves = Signature(
        inputs=[TensorSig("x", "FP32", (-1, 1))],
        outputs=[TensorSig("a", "FP32", (-1, 1)), TensorSig("b", "FP16", (-1, 1))],
    )
    mixed = oip.ModelInferResponse()
    both = NamedRows({"a": np.ones((1, 1), np.float32), "b": np.ones((1, 1), np.float16)})
    encode_outputs(mixed, both, halves, ("a", "b"), raw=False)
    assert len(mixed.raw_output_contents) == 2
    assert not mixed.outputs[0].contents.fp32_contents


# --- the runner --------------------------------------------------------------------------


def test_runner_feeds_named_inputs_in_order_and_reads_outputs_by_position() -> None:
    model = Churn()
    runner = ModelRunner(model, model="churn", version="v1", signature=CHURN_SIGNATURE)
    features, category = churn_rows(5)
    result = runner.run(NamedRows({"features": features, "category": category}))
    assert isinstance(result, NamedRows) and list(result) == ["probabilities", "label"]
    probabilities, label = churn_reference(model, features, category)
    np.testing.assert_allclose(result["probabilities"], probabilities, rtol=1e-6)
    np.testing.assert_array_equal(result["label"], label)
    assert sorted(runner.warm_up([1, 4])) == [1, 4]


class AsDict(torch.nn.Module):
    def forward(self, features: torch.Tensor, category: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"label": category * 0, "probabilities": features[:, :3].softmax(-1)}


def test_a_model_answering_a_dict_is_read_by_output_name() -> None:
    runner = ModelRunner(AsDict(), model="churn", version="v1", signature=CHURN_SIGNATURE)
    features, category = churn_rows(2)
    result = runner.run(NamedRows({"features": features, "category": category}))
    assert isinstance(result, NamedRows)
    assert result["label"].tolist() == [0, 0] and result["probabilities"].shape == (2, 3)


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        (
            [TensorSig("probabilities", "FP32", (-1, 3)), TensorSig("label", "FP32", (-1,))],
            "model output 'label' is INT64, the signature says FP32",
        ),
        (
            [TensorSig("probabilities", "FP32", (-1, 4)), TensorSig("label", "INT64", (-1,))],
            r"model output 'probabilities' rows are \[3\], expected \[4\]",
        ),
        (
            [TensorSig("probabilities", "FP32", (-1, 3))],
            "model returned 2 outputs, the signature declares 1",
        ),
    ],
    ids=["datatype", "dims", "count"],
)
def test_a_model_that_breaks_its_signature_fails_warm_up(
    outputs: list[TensorSig], message: str
) -> None:
    signature = Signature(inputs=CHURN_SIGNATURE.inputs, outputs=outputs)
    runner = ModelRunner(Churn(), model="churn", version="v1", signature=signature)
    with pytest.raises(ValueError, match=message):
        runner.warm_up([1])


# --- batching ----------------------------------------------------------------------------


class Recording:
    """A runner that remembers the rows of every batch it ran."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.sizes: list[int] = []

    def run(self, batch: Rows) -> Rows:
        self.sizes.append(row_count(batch))
        return self.runner.run(batch)


async def test_multi_tensor_requests_share_a_batch_and_a_bad_one_fails_alone() -> None:
    model = Churn()
    recording = Recording(
        ModelRunner(model, model="churn", version="v1", signature=CHURN_SIGNATURE)
    )
    clock = ManualClock()
    batcher = Batcher(
        recording,
        BatchingSpec(max_batch_size=8),
        name="churn:v1",
        expected_s={1: 0.001},
        clock=clock,
    )
    requests = [churn_rows(2, seed=i) for i in range(4)]
    # Category 99 is past the embedding's 5 rows: torch raises on this request's rows only.
    requests[2] = (requests[2][0], np.array([1, 99], np.int64))
    try:
        outcomes = await asyncio.gather(
            *(
                batcher.submit(NamedRows({"features": f, "category": c}), clock.now() + 10, f"r{i}")
                for i, (f, c) in enumerate(requests)
            ),
            return_exceptions=True,
        )
    finally:
        clock.advance(3600)
        await batcher.close()
    assert recording.sizes[0] == 8  # all four in one forward pass first
    for index, ((features, category), outcome) in enumerate(zip(requests, outcomes, strict=True)):
        if index == 2:
            assert isinstance(outcome, InferenceFailed)
            continue
        assert isinstance(outcome, NamedRows) and outcome.n_rows == 2
        probabilities, label = churn_reference(model, features, category)
        np.testing.assert_allclose(outcome["probabilities"], probabilities, rtol=1e-5)
        np.testing.assert_array_equal(outcome["label"], label)
    assert batcher.stats.outcomes["failed"] == 1 and batcher.stats.outcomes["ok"] == 3


# --- through the model server ------------------------------------------------------------


Built = dict[str, tuple[torch.nn.Module, tuple[torch.Tensor, ...], Signature]]


def artifact_loader(models: Built, format: Format) -> ModelLoader:
    """A ModelLoader serving `models` as version v1, saved in `format` first."""

    async def load(model: str, version: str) -> LoadedModel:
        if model not in models or version != "v1":
            where = f"model {model!r} version {version!r}"
            raise LoadError(f"{where}: none", code=grpc.StatusCode.NOT_FOUND)
        module, example, signature = models[model]
        data = scripted(module) if format == "torchscript" else exported(module, example)
        return await load_model(
            data,
            model=model,
            version=version,
            sha256=hashlib.sha256(data).hexdigest(),
            signature=signature,
            format=format,
            batching=BatchingSpec(max_batch_size=8),
        )

    return load


@pytest.fixture(params=["torchscript", "torch_export"])
async def multi(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Stub, Churn]]:
    """Churn and Dtypes served by one replica, as TorchScript or as exported programs."""
    churn = Churn(seed=3)
    models: Built = {
        "churn": (churn, churn_example(), CHURN_SIGNATURE),
        "dtypes": (Dtypes(), dtypes_example(), DTYPES_SIGNATURE),
    }
    servicer = InferenceServicer(
        replica="model-fraud-zone-a-0",
        loader=artifact_loader(models, request.param),
        expected=[("churn", "v1"), ("dtypes", "v1")],
    )
    await servicer.repository.load_all()
    async with serving(servicer) as (stub, _):
        yield stub, churn


async def test_two_inputs_and_two_outputs_answer_through_oip(multi: tuple[Stub, Churn]) -> None:
    stub, churn = multi
    features, category = churn_rows(3, seed=7)
    probabilities, label = churn_reference(churn, features, category)
    for raw in (True, False):
        response = await stub.ModelInfer(churn_request(features, category, raw=raw), timeout=10)
        assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
            ("probabilities", "FP32", [3, 3]),
            ("label", "INT64", [3]),
        ]
        if raw:
            got_p = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(3, 3)
            got_l = np.frombuffer(response.raw_output_contents[1], "<i8")
        else:
            got_p = np.asarray(response.outputs[0].contents.fp32_contents).reshape(3, 3)
            got_l = np.asarray(response.outputs[1].contents.int64_contents)
        np.testing.assert_allclose(got_p, probabilities, rtol=1e-5)
        np.testing.assert_array_equal(got_l, label)
    only = churn_request(features, category)
    only.outputs.add(name="label")
    response = await stub.ModelInfer(only, timeout=10)
    assert [o.name for o in response.outputs] == ["label"]
    meta = await stub.ModelMetadata(oip.ModelMetadataRequest(name="churn"))
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("features", "FP32", [-1, CHURN_FEATURES]),
        ("category", "INT64", [-1]),
    ]


async def test_a_wrong_datatype_is_invalid_argument_naming_the_input(
    multi: tuple[Stub, Churn],
) -> None:
    stub, _ = multi
    features, category = churn_rows(2)
    request = churn_request(features, category.astype(np.int32))
    request.inputs[1].datatype = "INT32"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ModelInfer(request, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        "inputs[1].datatype: expected INT64 for input 'category', got INT32"
    )
    # The replica keeps serving.
    assert (await stub.ModelInfer(churn_request(features, category), timeout=10)).outputs


async def test_fp16_bf16_bool_and_int32_round_trip(multi: tuple[Stub, Churn]) -> None:
    stub, _ = multi
    half = np.array([[0.5, -1.25, 3.0], [2.0, 0.0, -0.125]], np.float16)
    brain_values = torch.tensor([[1.5, -2.0, 0.25], [8.0, -0.5, 3.0]], dtype=torch.bfloat16)
    brain = to_array(brain_values)  # BF16 on the wire: its bit patterns, little-endian
    flags = np.array([True, False])
    counts = np.array([[1, -2], [2**20, 7]], np.int32)
    request = Request(model_name="dtypes")
    for name, datatype, array in (
        ("half", "FP16", half),
        ("brain", "BF16", brain),
        ("flags", "BOOL", flags),
        ("counts", "INT32", counts),
    ):
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(array.astype(array.dtype.newbyteorder("<")).tobytes())
    response = await stub.ModelInfer(request, timeout=10)
    out = {o.name: (o, response.raw_output_contents[i]) for i, o in enumerate(response.outputs)}
    assert [(o.datatype, list(o.shape)) for o, _ in out.values()] == [
        ("FP16", [2, 3]),
        ("BF16", [2, 3]),
        ("BOOL", [2]),
        ("INT32", [2, 2]),
    ]
    np.testing.assert_array_equal(
        np.frombuffer(out["half_doubled"][1], "<f2").reshape(2, 3), half * 2
    )
    got_brain = torch.from_numpy(
        np.frombuffer(out["brain_plus_one"][1], "<u2").reshape(2, 3).copy()
    ).view(torch.bfloat16)
    assert torch.equal(got_brain, brain_values + 1)
    assert np.frombuffer(out["flags_flipped"][1], "|b1").tolist() == [False, True]
    np.testing.assert_array_equal(
        np.frombuffer(out["counts_tripled"][1], "<i4").reshape(2, 2), counts * 3
    )
