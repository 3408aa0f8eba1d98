"""servemesh.quantize without a registry: the derived artifact, its checks and its numbers."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from servemesh.contract.demo import N_FEATURES, demo_artifact, heavy_artifact
from servemesh.quantize import (
    QuantizeError,
    QuantizeRefused,
    VersionRecord,
    measure_accuracy,
    quantize_version,
)
from servemesh.registry.records import TensorSpec
from servemesh.services.model.artifacts import open_artifact
from servemesh.services.model.tensors import Signature
from tests.model.torch_models import CHURN_FEATURES, Churn, churn_example, exported
from tests.sandbox.spy import sandbox_spy


def demo_record(data: bytes, format: str = "torchscript", model: str = "fraud") -> VersionRecord:
    return VersionRecord(
        model=model,
        version="v1",
        sha256=hashlib.sha256(data).hexdigest(),
        format=format,
        inputs=[TensorSpec("features", "FP32", (-1, N_FEATURES))],
        outputs=[TensorSpec("score", "FP32", (-1, 1))],
    )


def churn_record(data: bytes) -> VersionRecord:
    return VersionRecord(
        model="churn",
        version="v1",
        sha256=hashlib.sha256(data).hexdigest(),
        format="torch_export",
        inputs=[
            TensorSpec("features", "FP32", (-1, CHURN_FEATURES)),
            TensorSpec("category", "INT64", (-1,)),
        ],
        outputs=[TensorSpec("probabilities", "FP32", (-1, 3)), TensorSpec("label", "INT64", (-1,))],
    )


def test_int8_of_the_demo_model_is_smaller_close_and_the_same_bytes_each_time() -> None:
    source = demo_artifact(3).data
    record = demo_record(source)
    first = quantize_version(source, record, "int8")
    again = quantize_version(source, record, "int8")
    assert first.data == again.data and first.sha256 == again.sha256
    assert first.sha256 == hashlib.sha256(first.data).hexdigest()
    assert (first.method, first.layers, first.format) == ("dynamic-int8", 3, "torchscript")
    assert first.lineage() == {
        "source_version": "v1",
        "source_sha256": record.sha256,
        "method": "dynamic-int8",
    }
    assert 0 < first.accuracy.max_abs_error <= 0.05
    assert first.accuracy.rows == 66  # zeros, ones and 64 drawn rows

    # Loaded the way a model server loads any artifact: through the guard and allowlist.
    opened = open_artifact(first.data)
    rows = torch.from_numpy(np.random.default_rng(1).normal(size=(8, N_FEATURES)).astype("f4"))
    want = open_artifact(source).module(rows)
    got = opened.module(rows)
    assert got.dtype == torch.float32 and got.shape == (8, 1)
    assert torch.allclose(got, want, atol=0.05)


def test_int8_of_the_heavy_export_program_quarters_its_weights() -> None:
    artifact = heavy_artifact(1)
    derived = quantize_version(
        artifact.data, demo_record(artifact.data, artifact.format, "heavy"), "int8"
    )
    assert derived.layers == 3
    assert len(derived.data) < len(artifact.data) / 3
    assert derived.accuracy.max_abs_error <= 0.05


@pytest.mark.parametrize(("to", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_types_keep_the_declared_inputs_and_outputs(to: str, dtype: torch.dtype) -> None:
    model = Churn(seed=1)
    data = exported(model, churn_example())
    rng = np.random.default_rng(0)
    rows = {
        "features": rng.normal(size=(20, CHURN_FEATURES)).astype(np.float32),
        "category": rng.integers(0, 5, size=20),
    }
    derived = quantize_version(data, churn_record(data), to, rows=rows)  # type: ignore[arg-type]
    assert derived.method == to and derived.accuracy.rows == 20
    module = open_artifact(derived.data).module
    assert isinstance(module, torch.jit.ScriptModule)
    weights = [t for t in module.state_dict().values() if t.is_floating_point()]
    assert weights and all(t.dtype == dtype for t in weights)
    probabilities, label = module(
        torch.from_numpy(rows["features"]), torch.from_numpy(rows["category"])
    )
    assert (probabilities.dtype, label.dtype) == (torch.float32, torch.int64)
    assert derived.accuracy.label_agreement >= 0.99


def test_a_model_without_linear_layers_has_nothing_for_int8() -> None:
    data = exported(Churn(seed=1), churn_example())
    with pytest.raises(QuantizeError, match="no linear layer with constant weights"):
        quantize_version(data, churn_record(data), "int8")


def test_limits_refuse_with_the_numbers() -> None:
    source = demo_artifact(3).data
    with pytest.raises(QuantizeRefused, match=r"max \|error\| .* \(limit 0\).*nothing was pushed"):
        quantize_version(source, demo_record(source), "int8", max_abs_error=0)
    for bad in ({"max_abs_error": -1.0}, {"max_abs_error": float("nan")}, {"min_agreement": 2.0}):
        with pytest.raises(QuantizeError, match="must be"):
            quantize_version(source, demo_record(source), "int8", **bad)  # type: ignore[arg-type]
    with pytest.raises(QuantizeError, match="is not one of"):
        quantize_version(source, demo_record(source), "int4")  # type: ignore[arg-type]


def test_reference_rows_must_fit_the_signature() -> None:
    source = demo_artifact(3).data
    with pytest.raises(QuantizeError, match=r"input 'features' has shape \[4, 3\]"):
        quantize_version(source, demo_record(source), "int8", rows={"features": np.zeros((4, 3))})
    with pytest.raises(QuantizeError, match=r"no values for input\(s\) \['features'\]"):
        quantize_version(source, demo_record(source), "int8", rows={})


def signature(*outputs: TensorSpec) -> Signature:
    return Signature.from_specs([TensorSpec("x", "FP32", (-1, 1))], list(outputs), where="test")


def test_accuracy_reads_labels_by_argmax_or_threshold_and_integers_exactly() -> None:
    several = signature(TensorSpec("p", "FP32", (-1, 3)))
    want = [np.array([[0.1, 0.8, 0.1], [0.5, 0.3, 0.2]])]
    have = [np.array([[0.1, 0.7, 0.2], [0.3, 0.45, 0.25]])]
    accuracy = measure_accuracy(several, want, have)
    assert accuracy.rows == 2 and accuracy.label_agreement == 0.5
    assert accuracy.max_abs_error == pytest.approx(0.2)

    one = signature(TensorSpec("score", "FP32", (-1, 1)))
    accuracy = measure_accuracy(one, [np.array([[0.49], [0.9]])], [np.array([[0.51], [0.88]])])
    assert accuracy.label_agreement == 0.5 and accuracy.max_abs_error == pytest.approx(0.02)

    labels = signature(TensorSpec("label", "INT64", (-1,)))
    accuracy = measure_accuracy(labels, [np.array([1, 2, 3, 4])], [np.array([1, 2, 0, 4])])
    assert (accuracy.label_agreement, accuracy.max_abs_error) == (0.75, 0.0)

    nan = measure_accuracy(one, [np.array([[0.5]])], [np.array([[np.nan]])])
    assert nan.max_abs_error == float("inf")
    with pytest.raises(QuantizeError, match="answers shape"):
        measure_accuracy(one, [np.zeros((2, 1))], [np.zeros((3, 1))])


def test_the_derivation_and_both_checks_run_in_sandboxed_children(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = demo_artifact(3).data
    record = demo_record(source)
    spy = sandbox_spy(monkeypatch)  # loading a model in this process now raises
    derived = quantize_version(source, record, "int8")
    # The source in the quantize child (derive, then its answers), the derived model in a
    # plain child of its own.
    assert [o.entry for o in spy.opened] == [
        ("-m", "servemesh.quantize"),
        ("-m", "servemesh.sandbox.child"),
    ]
    assert {o.seccomp for o in spy.opened} == {"2"}
    monkeypatch.undo()
    assert open_artifact(derived.data).format == "torchscript"
    assert derived.layers == 3 and derived.accuracy.max_abs_error <= 0.05
