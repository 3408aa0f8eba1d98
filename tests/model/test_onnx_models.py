"""ONNX models: what the checks refuse before onnxruntime sees a graph (each hostile or broken
file written here first), and what a served tree model answers: the library's own
`predict_proba`, in the process and from a sandboxed child."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from examples.trees.train import Data, Fitted, fit, forest_onnx, gbm_onnx, load
from servemesh.sandbox.model import ModelRefused, SandboxedModel
from servemesh.services.model.artifacts import (
    PLATFORMS,
    ArtifactError,
    detect_format,
    open_artifact,
    reconcile_signature,
)
from servemesh.services.model.batching.rows import NamedRows
from servemesh.services.model.runner import ModelRunner
from servemesh.services.model.tensors import Signature, TensorSig

OPSET = 17


def _graph_model(
    nodes: list[onnx.NodeProto],
    *,
    inputs: list[onnx.ValueInfoProto] | None = None,
    outputs: list[onnx.ValueInfoProto] | None = None,
    initializers: list[onnx.TensorProto] | None = None,
    opsets: list[onnx.OperatorSetIdProto] | None = None,
    functions: list[onnx.FunctionProto] | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        inputs if inputs is not None else [_tensor("x", TensorProto.FLOAT, ["N", 3])],
        outputs if outputs is not None else [_tensor("y", TensorProto.FLOAT, ["N", 3])],
        initializer=initializers or [],
    )
    return helper.make_model(
        graph,
        opset_imports=opsets or [helper.make_opsetid("", OPSET)],
        functions=functions or [],
        ir_version=8,
    )


def _tensor(name: str, elem: int, shape: list[int | str | None]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _bias(name: str = "b") -> onnx.TensorProto:
    return numpy_helper.from_array(np.array([1.0, 2.0, 3.0], dtype=np.float32), name)


def plus_bias() -> onnx.ModelProto:
    """y = x + [1, 2, 3]: the smallest model the checks pass."""
    return _graph_model([helper.make_node("Add", ["x", "b"], ["y"])], initializers=[_bias()])


def _bytes(model: onnx.ModelProto) -> bytes:
    return bytes(model.SerializeToString())


def _refused(model: onnx.ModelProto) -> str:
    with pytest.raises(ArtifactError) as caught:
        open_artifact(_bytes(model))
    return str(caught.value)


def test_a_plain_graph_is_detected_loaded_and_run_with_its_recorded_signature() -> None:
    data = _bytes(plus_bias())
    assert detect_format(data) == "onnx"
    opened = open_artifact(data)
    assert opened.format == "onnx" and PLATFORMS["onnx"] == "onnxruntime_onnx"
    assert opened.signature == Signature.from_specs(
        [TensorSig("x", "FP32", (-1, 3))], [TensorSig("y", "FP32", (-1, 3))]
    )
    runner = ModelRunner(
        opened.module, model="m", version="v", signature=opened.signature, device="cpu"
    )
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(runner.run(rows), rows + [1, 2, 3])
    assert runner.weight_bytes() == len(data)


def test_bytes_that_are_no_model_are_named_as_such() -> None:
    for junk in (b"", b"hello, world", bytes(range(256)) * 4):
        with pytest.raises(ArtifactError, match="not a model"):
            detect_format(junk)


def test_a_custom_operator_domain_is_refused() -> None:
    model = _graph_model(
        [helper.make_node("Evil", ["x"], ["y"], domain="com.example.native")],
        opsets=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.example.native", 1)],
    )
    assert "'com.example.native' is not a standard one" in _refused(model)


def test_a_custom_operator_hidden_in_a_subgraph_is_refused() -> None:
    hidden = helper.make_graph(
        [helper.make_node("Evil", ["x"], ["z"], domain="com.example.native")],
        "then",
        [],
        [_tensor("z", TensorProto.FLOAT, ["N", 3])],
    )
    plain = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["w"])],
        "else",
        [],
        [_tensor("w", TensorProto.FLOAT, ["N", 3])],
    )
    condition = numpy_helper.from_array(np.array(True), "c")
    model = _graph_model(
        [helper.make_node("If", ["c"], ["y"], then_branch=hidden, else_branch=plain)],
        initializers=[condition],
    )
    refused = _refused(model)
    assert "com.example.native::Evil" in refused and "then_branch" in refused


def test_a_function_defined_in_the_file_may_be_called_but_not_hide_a_custom_op() -> None:
    def with_body(op: str, domain: str) -> onnx.ModelProto:
        body = helper.make_function(
            "local.fns", "Double", ["a"], ["b"],
            [helper.make_node(op, ["a", "a"], ["b"], domain=domain)],
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(domain, 1)]
            if domain else [helper.make_opsetid("", OPSET)],
        )  # fmt: skip
        return _graph_model(
            [helper.make_node("Double", ["x"], ["y"], domain="local.fns")],
            opsets=[helper.make_opsetid("", OPSET), helper.make_opsetid("local.fns", 1)],
            functions=[body],
        )

    data = _bytes(with_body("Add", ""))
    runner = ModelRunner(open_artifact(data).module, model="m", version="v",
                         signature=open_artifact(data).signature, device="cpu")  # fmt: skip
    np.testing.assert_array_equal(runner.run(np.ones((2, 3), np.float32)), np.full((2, 3), 2.0))
    refused = _refused(with_body("Evil", "com.example.native"))
    assert "function local.fns::Double: node 'Evil' is com.example.native::Evil" in refused


def test_tensors_kept_in_an_external_file_are_refused() -> None:
    weights = _bias()
    weights.ClearField("raw_data")
    weights.ClearField("float_data")
    weights.data_location = TensorProto.EXTERNAL
    entry = weights.external_data.add()
    entry.key, entry.value = "location", "../../etc/shadow"
    model = _graph_model([helper.make_node("Add", ["x", "b"], ["y"])], initializers=[weights])
    refused = _refused(model)
    assert "external file ('../../etc/shadow')" in refused and "save_as_external_data" in refused


def test_opsets_outside_the_supported_range_are_refused() -> None:
    too_new = plus_bias()
    too_new.opset_import[0].version = 999
    assert "opset ai.onnx 999 is outside the supported 7.." in _refused(too_new)
    too_old = plus_bias()
    too_old.opset_import[0].version = 1
    assert "opset ai.onnx 1 is outside" in _refused(too_old)
    no_ir = plus_bias()
    no_ir.ir_version = 99
    assert "IR version 99 is outside" in _refused(no_ir)


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (
            helper.make_value_info(
                "y",
                helper.make_sequence_type_proto(
                    helper.make_map_type_proto(
                        TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, [])
                    )
                ),
            ),
            "output 'y' is a sequence_type, not a tensor; a classifier's ZipMap output: "
            "convert with options={'zipmap': False}",
        ),
        (_tensor("y", TensorProto.FLOAT, [4, 3]), "output 'y' has a fixed first dim 4"),
        (_tensor("y", TensorProto.FLOAT, ["N", "M"]), "output 'y' dim 1 is dynamic"),
        (_tensor("y", TensorProto.STRING, ["N", 3]), "output 'y' is STRING"),
    ],
)
def test_outputs_that_are_not_batched_tensors_are_refused(
    value: onnx.ValueInfoProto, said: str
) -> None:
    model = _graph_model(
        [helper.make_node("Add", ["x", "b"], ["y"])], outputs=[value], initializers=[_bias()]
    )
    assert said in _refused(model)


def test_a_declared_signature_must_match_the_graph() -> None:
    opened = open_artifact(_bytes(plus_bias()))
    declared = Signature.from_specs(
        [TensorSig("features", "FP32", (-1, 4))], [TensorSig("score", "FP32", (-1, 3))]
    )
    with pytest.raises(ArtifactError, match=r"declared inputs\[0\] 'features' is FP32 \[-1, 4\]"):
        reconcile_signature(opened.signature, declared)


@cache
def _trees() -> tuple[Data, Fitted]:
    data = load()
    return data, fit(data)


def _converters() -> dict[str, Callable[[Fitted], tuple[Any, bytes]]]:
    return {
        "scikit-learn forest": lambda f: (f.forest, forest_onnx(f.forest)),
        "lightgbm": lambda f: (f.gbm, gbm_onnx(f.gbm)),
    }


@pytest.mark.parametrize("kind", sorted(_converters()))
def test_a_converted_tree_model_answers_the_librarys_predict_proba(kind: str) -> None:
    data, fitted = _trees()
    library, converted = _converters()[kind](fitted)
    opened = open_artifact(converted)
    assert [t.name for t in opened.signature.outputs] == ["label", "probabilities"]  # type: ignore[union-attr]
    runner = ModelRunner(
        opened.module, model="m", version="v", signature=opened.signature, device="cpu"
    )
    rows = data.measurements[data.held]
    answer = runner.run(NamedRows({"measurements": rows}))
    assert isinstance(answer, NamedRows)
    np.testing.assert_allclose(
        answer["probabilities"], library.predict_proba(rows), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_array_equal(answer["label"], library.predict(rows))


def test_a_tree_model_loads_and_answers_in_its_sandbox() -> None:
    data, fitted = _trees()
    rows = data.measurements[data.held][:8]
    with SandboxedModel.open(gbm_onnx(fitted.gbm), model="wine-gbm", version="v1") as sandboxed:
        assert sandboxed.format == "onnx"
        answer = sandboxed.run({"measurements": rows})
    np.testing.assert_allclose(
        answer["probabilities"], fitted.gbm.predict_proba(rows), rtol=1e-4, atol=1e-5
    )


def test_the_sandbox_refuses_a_hostile_graph_before_it_runs() -> None:
    model = _graph_model(
        [helper.make_node("Evil", ["x"], ["y"], domain="com.example.native")],
        opsets=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.example.native", 1)],
    )
    with pytest.raises(ModelRefused, match="custom operators are not run"):
        SandboxedModel.open(_bytes(model)).close()


def test_the_example_converts_to_the_same_bytes_every_time() -> None:
    data = load()
    first, again = fit(data), fit(data)
    assert forest_onnx(first.forest) == forest_onnx(again.forest)
    assert gbm_onnx(first.gbm) == gbm_onnx(again.gbm)


def test_quantize_and_export_name_what_to_do_with_an_onnx_version_instead() -> None:
    from types import SimpleNamespace

    from servemesh.edge.export import ExportError, export_version
    from servemesh.quantize import QuantizeError, quantize_version

    data = _bytes(plus_bias())
    record = SimpleNamespace(model="m", version="v1", format="onnx", sha256="0" * 64)
    with pytest.raises(QuantizeError, match="quantize it with onnxruntime.quantization"):
        quantize_version(data, record, "int8")
    with pytest.raises(ExportError, match="an ONNX model already: `edge sync --format artifact`"):
        export_version(data, record, "onnx")
