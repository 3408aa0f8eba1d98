"""Every wire name is spelled once: in servemesh/contract/wire.py, and nowhere else in the
product."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from servemesh.contract import wire
from servemesh_api.feature.v1 import feature_pb2
from servemesh_api.gateway.v1 import gateway_pb2
from servemesh_api.inference import grpc_service_pb2
from servemesh_api.registry.v1 import registry_pb2

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ["servemesh", "services", "registry", "chaos"]

# The literal spellings the contract owns, as a quoted string would show them in code. Plain
# words ("gateway", "shadow") also name other things, so only compound names are checked.
OWNED = sorted(
    {
        value
        for name, value in vars(wire).items()
        if name.isupper() and isinstance(value, str) and not value.isalpha()
    }
    | {"-via-", "grpc.max_send_message_length", "grpc.max_receive_message_length"}
)


# Parsing every module takes a second: done once, by the first test that needs it, never
# while pytest collects (every worker collects every module).
@functools.cache
def string_literals() -> list[tuple[str, str]]:
    """(where, text) of every string literal in the product's code, docstrings excepted."""
    found: list[tuple[str, str]] = []
    for folder in PRODUCT:
        for path in (REPO / folder).rglob("*.py"):
            if path == REPO / "servemesh" / "contract" / "wire.py":
                continue
            tree = ast.parse(path.read_text())
            docstrings = {
                id(node.body[0].value)
                for node in ast.walk(tree)
                if isinstance(
                    node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
                )
                and node.body
                and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if id(node) not in docstrings:
                        found.append((f"{path.relative_to(REPO)}:{node.lineno}", node.value))
    return found


@pytest.mark.parametrize("value", OWNED)
def test_no_module_but_the_wire_module_spells_it(value: str) -> None:
    spelled = [where for where, text in string_literals() if value in text]
    assert spelled == [], (
        f"{value!r} is spelled outside servemesh/contract/wire.py; import it from there"
    )


def test_cluster_names_read_back_their_zone() -> None:
    assert wire.zone_of_cluster(wire.model_cluster("fraud", "v1", "zone-b")) == "zone-b"
    assert wire.zone_of_cluster(wire.feature_cluster("zone-a")) == "zone-a"
    assert wire.zone_of_cluster(wire.GATEWAY_CLUSTER) is None
    assert wire.is_shadow_cluster(wire.shadow_cluster("fraud", "v2", "zone-a"))


def test_service_names_match_the_generated_descriptors() -> None:
    assert (
        wire.FEATURE_SERVICE == feature_pb2.DESCRIPTOR.services_by_name["FeatureService"].full_name
    )
    assert wire.GATEWAY_SERVICE == gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
    assert wire.REGISTRY_SERVICE == registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name
    oip = grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert wire.OIP_SERVICE == oip.full_name
    assert wire.MODEL_INFER_METHOD == f"/{oip.full_name}/{oip.methods_by_name['ModelInfer'].name}"
