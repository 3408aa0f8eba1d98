"""The mesh spec: defaults, validation errors that name the field and line, port resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from servemesh.spec import MeshSpec, SpecError, load_spec, parse_spec, resolve_ports

REPO = Path(__file__).resolve().parents[2]


def test_repo_mesh_yaml_is_exactly_the_built_in_defaults() -> None:
    assert load_spec(REPO / "mesh.yaml") == MeshSpec()


def test_empty_spec_is_the_demo_mesh() -> None:
    spec = parse_spec("")
    assert set(spec.models) == {"fraud"}
    assert [i.name for i in spec.instances()][:3] == [
        "registry-0",
        "model-zone-a-0",
        "model-zone-b-0",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "models:\n  fraud:\n    traffic: {v1: 90, v2: 20}\n",
            "<t>:2: models.fraud: Value error, traffic: weights must sum to 100, got 110",
        ),
        ("models:\n  fraud:\n    traffic: {v1: 50, v3: 50}\n", "unknown versions ['v3']"),
        ("gateway:\n  per_zone: {zone-x: 1}\n", "unknown zones ['zone-x']"),
        ("limits:\n  max_message_bytes: -1\n", "<t>:2: limits.max_message_bytes"),
        ("host: 10.0.0.1\n", "<t>:1: host"),
        ("bogus: 1\n", "<t>:1: bogus: Extra inputs are not permitted"),
        ("models: [\n", "malformed YAML"),
        ("- a\n", "must be a mapping"),
    ],
)
def test_invalid_specs_name_field_and_line(text: str, expected: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(text, "<t>")
    assert expected in str(err.value)


def test_resolve_ports_gives_every_instance_a_distinct_concrete_port() -> None:
    spec = resolve_ports(
        MeshSpec(ports={"edge": 0, "mesh": 0, "envoy_admin": 0, "services_base": 0})
    )
    ports = [
        spec.ports.edge,
        spec.ports.mesh,
        spec.ports.envoy_admin,
        *spec.instance_ports.values(),
    ]
    assert 0 not in ports and len(set(ports)) == len(ports)
    assert set(spec.instance_ports) == {i.name for i in spec.instances()}


def test_fixed_ports_are_consecutive_from_services_base() -> None:
    spec = resolve_ports(MeshSpec())
    assert (spec.ports.edge, spec.ports.mesh, spec.ports.envoy_admin) == (8080, 8081, 9901)
    assert [spec.port_of(i.name) for i in spec.instances()] == list(
        range(50051, 50051 + len(spec.instances()))
    )
