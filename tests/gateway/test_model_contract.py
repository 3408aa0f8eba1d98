"""A model's spec entry against an artifact's signature, and the spec's `inputs` rules."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from servemesh.contract.demo import demo_signature
from servemesh.spec import (
    MeshSpec,
    SpecError,
    dump_spec,
    parse_spec,
    parse_spec_or_resolved,
    resolve,
)
from servemesh.spec.model_contract import check_model_contract


@dataclass(frozen=True)
class T:
    name: str
    datatype: str
    shape: tuple[int, ...]


WINE_YAML = """
feature_views:
  lot: {entity: lot, features: [alcohol, malic_acid, ash]}
  user: {}
models:
  wine:
    inputs:
      chemistry: {view: lot, features: [alcohol, malic_acid, ash]}
      tasting: {raw: true}
    versions: {v1: {}}
    traffic: {v1: 100}
"""
WINE = parse_spec(WINE_YAML)
INPUTS = [T("chemistry", "FP32", (-1, 3)), T("tasting", "FP32", (-1, 3))]
OUTPUTS = [T("probabilities", "FP32", (-1, 3)), T("label", "INT64", (-1,))]


def test_a_fitting_signature_has_no_problems() -> None:
    assert check_model_contract("wine", WINE.models["wine"], INPUTS, OUTPUTS) == []


def test_the_demo_model_fits_its_shorthand() -> None:
    signature = demo_signature(64)
    inputs = [T(t["name"], t["datatype"], tuple(t["shape"])) for t in signature["inputs"]]  # type: ignore[arg-type]
    outputs = [T(t["name"], t["datatype"], tuple(t["shape"])) for t in signature["outputs"]]  # type: ignore[arg-type]
    assert check_model_contract("fraud", MeshSpec().models["fraud"], inputs, outputs) == []
    narrow = [T("features", "FP32", (-1, 63))]
    assert check_model_contract("fraud", MeshSpec().models["fraud"], narrow, outputs) == [
        "models.fraud.features: input 'features' has shape [-1, 63] but the spec lists 64 "
        "features (shape [-1, 64])"
    ]


def test_every_mismatch_is_listed_naming_its_field() -> None:
    inputs = [
        T("chemistry", "INT64", (-1, 4)),  # a view's floats into INT64, and one too wide
        T("smell", "FP32", (-1, 2)),  # not mapped
        T("tasting", "BYTES", (-1, 1)),
    ]
    problems = check_model_contract("wine", WINE.models["wine"], inputs, [T("o", "STRING", (-1,))])
    assert problems == [
        "models.wine.inputs: the model's input 'smell' is not mapped; the spec fills "
        "['chemistry', 'tasting']",
        "models.wine.inputs.chemistry: input 'chemistry' is INT64 but is filled from feature "
        "view 'lot', whose values are floats; one of ['BF16', 'FP16', 'FP32', 'FP64']",
        "models.wine.inputs.chemistry.features: input 'chemistry' has shape [-1, 4] but the spec "
        "lists 3 features (shape [-1, 3])",
        "models.wine.inputs.tasting: input 'tasting' is BYTES, which the gateway does not carry; "
        "one of ['BF16', 'BOOL', 'FP16', 'FP32', 'FP64', 'INT16', 'INT32', 'INT64', 'INT8', "
        "'UINT16', 'UINT32', 'UINT64', 'UINT8']",
        "models.wine: output 'o' is STRING, which the gateway does not carry; one of ['BF16', "
        "'BOOL', 'FP16', 'FP32', 'FP64', 'INT16', 'INT32', 'INT64', 'INT8', 'UINT16', 'UINT32', "
        "'UINT64', 'UINT8']",
    ]
    missing = check_model_contract("wine", WINE.models["wine"], INPUTS[:1], OUTPUTS)
    assert missing == [
        "models.wine.inputs.tasting: the model has no input tensor 'tasting'; it takes "
        "['chemistry']"
    ]


def test_inputs_survive_a_resolved_spec_written_and_read_back() -> None:
    again = parse_spec_or_resolved(dump_spec(resolve(WINE)))
    assert again.models["wine"].effective_inputs == WINE.models["wine"].effective_inputs
    assert again.entities_of(again.models["wine"]) == ["lot"]
    assert MeshSpec().models["fraud"].effective_inputs["features"].view == "user"


def test_a_view_is_keyed_by_its_entity_or_its_own_name() -> None:
    spec = parse_spec(WINE_YAML.replace("lot: {entity: lot,", "lot: {entity: batch,"))
    assert spec.entity_of("lot") == "batch" and spec.entity_of("user") == "user"


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "{view: lot, features:",
            "{view: cask, features:",
            "models.wine.inputs.chemistry.view: 'cask' is not one of feature_views ['lot', 'user']",
        ),
        (
            "{view: lot, features: [alcohol",
            "{view: lot, features: [sugar",
            "models.wine.inputs.chemistry.features: not in feature view 'lot': ['sugar']",
        ),
        (
            "tasting: {raw: true}",
            "tasting: {raw: true, view: lot}",
            "models.wine.inputs.tasting: Value error, raw: an input is raw or read from a view",
        ),
        (
            "tasting: {raw: true}",
            "tasting: {view: lot}",
            "models.wine.inputs.tasting: Value error, features: required with view 'lot'",
        ),
        (
            "tasting: {raw: true}",
            "tasting: {features: [ash]}",
            "models.wine.inputs.tasting: Value error, view: required",
        ),
        (
            "    versions: {v1: {}}",
            "    feature_view: user\n    versions: {v1: {}}",
            "models.wine: Value error, feature_view: the shorthand for one input named 'features'",
        ),
    ],
)
def test_bad_inputs_name_their_field(old: str, new: str, expected: str) -> None:
    text = WINE_YAML.replace(old, new, 1)
    assert text != WINE_YAML
    with pytest.raises(SpecError) as err:
        parse_spec(text)
    assert expected in str(err.value)
