"""`servemesh predict`'s --entity and --input, read into a PredictRequest's fields."""

from __future__ import annotations

import pytest

from servemesh.cli import build_parser
from servemesh.cli.predict import _input_tensors, _parse_entity


def test_entities_are_named_or_a_bare_id() -> None:
    assert _parse_entity("user-42") == "user-42"
    assert _parse_entity("lot=L-17, merchant=m-3") == {"lot": "L-17", "merchant": "m-3"}
    with pytest.raises(ValueError, match="--entity 'lot=': give name=id"):
        _parse_entity("lot=")


def test_each_input_flag_is_one_row_of_its_tensor_in_order() -> None:
    tensors = _input_tensors(["tasting=1,2.5,3", "category=7", "tasting=4,5,6", "category=2"])
    assert list(tensors["tasting"].shape) == [2, 3]
    assert list(tensors["tasting"].double_values) == [1, 2.5, 3, 4, 5, 6]
    # Whole numbers travel exactly, as integers (an INT64 id above 2**53 stays itself).
    assert list(tensors["category"].int64_values) == [7, 2]
    big = _input_tensors([f"id={2**60 + 1}"])["id"]
    assert list(big.int64_values) == [2**60 + 1]
    with pytest.raises(ValueError, match="every row needs as many values"):
        _input_tensors(["t=1,2", "t=1"])
    with pytest.raises(ValueError, match="not a comma-separated list of numbers"):
        _input_tensors(["t=1,x"])


def test_the_parser_takes_repeated_entities_and_inputs() -> None:
    args = build_parser().parse_args(
        ["predict", "--model", "wine", "--entity", "lot=L-1", "--input", "t=1", "--input", "t=2"]
    )
    assert args.entity == ["lot=L-1"] and args.input == ["t=1", "t=2"] and not args.json
