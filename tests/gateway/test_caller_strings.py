"""Caller strings in the gateway's refusals are quoted and cut short, by the one rule
(servemesh/contract/echo.py) every service uses."""

from __future__ import annotations

import pytest

from servemesh.contract.echo import MAX_SHOWN, brief, brief_list, shown
from servemesh.services.gateway.predict import plan_predict
from servemesh.services.runtime.errors import MeshError
from servemesh.spec import MeshSpec, ModelSpec
from servemesh_api.gateway.v1 import gateway_pb2


def test_shown_quotes_and_cuts() -> None:
    assert shown("fraud") == "'fraud'"
    assert shown("x" * 1000) == repr("x" * MAX_SHOWN + "...")
    assert shown("a\nb") == "'a\\nb'"  # a newline cannot start a forged log line


def test_brief_keeps_plain_names_plain_and_quotes_the_rest() -> None:
    assert brief("user-42") == "user-42"
    assert brief("user\n42") == "'user\\n42'"
    assert brief_list([str(i) for i in range(12)]) == "0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and 2 more"


@pytest.mark.parametrize(
    "request_",
    [
        gateway_pb2.PredictRequest(model="m" * 100_000, entity_ids=["u"]),
        gateway_pb2.PredictRequest(model="fraud", version="v" * 100_000, entity_ids=["u"]),
    ],
    ids=["model", "version"],
)
def test_an_unknown_model_or_version_comes_back_cut_short(
    request_: gateway_pb2.PredictRequest,
) -> None:
    spec = MeshSpec(models={"fraud": ModelSpec()})
    with pytest.raises(MeshError) as refused:
        plan_predict(request_, spec)
    assert len(refused.value.message) < 400
    assert "..." in refused.value.message
