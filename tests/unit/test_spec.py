"""The mesh spec: defaults, validation errors that name the field and line, port resolution."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from servemesh.spec import (
    FeatureStoreSpec,
    MeshSpec,
    Ports,
    SpecError,
    declared,
    dump_spec,
    load_resolved,
    load_spec,
    parse_resolved,
    parse_spec,
    resolve,
    with_profile,
)

REPO = Path(__file__).resolve().parents[2]


def test_repo_mesh_yaml_is_the_built_in_defaults_with_a_replicated_store() -> None:
    # The one difference, written down in mesh.yaml and docs/architecture.md: `up` in the
    # checkout runs the replicated store; the built-in defaults (every test mesh's) one Redis.
    spec = load_spec(REPO / "mesh.yaml")
    assert spec.feature_store.topology == "replicated"
    single = spec.feature_store.model_copy(update={"topology": "single"})
    assert spec.model_copy(update={"feature_store": single}) == MeshSpec()


def test_empty_spec_is_the_demo_mesh() -> None:
    spec = parse_spec("")
    assert set(spec.models) == {"fraud"}
    assert [i.name for i in spec.instances()][:3] == [
        "registry-0",
        "model-fraud-zone-a-0",
        "model-fraud-zone-b-0",
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


def test_resolve_gives_every_instance_a_distinct_concrete_port() -> None:
    spec = resolve(MeshSpec(ports=Ports.free()))
    ports = [
        spec.ports.edge,
        spec.ports.mesh,
        spec.ports.envoy_admin,
        *spec.instance_ports.values(),
    ]
    assert 0 not in ports and len(set(ports)) == len(ports)
    assert set(spec.instance_ports) == {i.name for i in spec.instances()}


def test_fixed_ports_are_consecutive_from_services_base() -> None:
    spec = resolve(MeshSpec())
    assert (spec.ports.edge, spec.ports.mesh, spec.ports.envoy_admin) == (8080, 8081, 9901)
    assert [spec.port_of(i.name) for i in spec.instances()] == list(
        range(50051, 50051 + len(spec.instances()))
    )


def test_a_declared_spec_has_no_addresses_and_its_file_may_not_name_resolved_ports() -> None:
    assert not hasattr(MeshSpec(), "port_of")
    with pytest.raises(SpecError) as err:
        parse_spec("instance_ports: {registry-0: 5000}\n", "<t>")
    assert "instance_ports" in str(err.value)


def test_resolving_a_resolved_spec_keeps_its_ports() -> None:
    first = resolve(MeshSpec(ports=Ports.free()))
    again = resolve(first)
    assert again == first


def test_a_resolved_spec_round_trips_through_its_file(tmp_path: Path) -> None:
    spec = resolve(MeshSpec(ports=Ports.free()))
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_spec(spec))
    assert load_resolved(path) == spec
    # What was declared, with the ports it was given: nothing the launcher added.
    assert declared(spec) == MeshSpec(ports=spec.ports)


def test_a_resolved_file_without_a_port_for_every_listener_is_refused() -> None:
    spec = resolve(MeshSpec())
    broken = spec.model_dump(mode="json")
    del broken["instance_ports"]["gateway-zone-b-0"]
    with pytest.raises(SpecError) as err:
        parse_resolved(yaml.safe_dump(broken), "<resolved>")
    assert "gateway-zone-b-0" in str(err.value)


def test_a_spec_without_redis_gets_the_launchers_own_on_a_port_chosen_with_the_others() -> None:
    spec = resolve(MeshSpec(ports=Ports.free()))
    assert spec.embedded_redis_port
    assert spec.redis_url == f"redis://127.0.0.1:{spec.embedded_redis_port}/0"
    assert spec.embedded_redis_port not in spec.instance_ports.values()
    assert declared(spec).feature_store.redis_url is None  # not something the file said
    own = resolve(MeshSpec(feature_store=FeatureStoreSpec(redis_url="redis://127.0.0.1:6400/0")))
    assert own.embedded_redis_port is None and own.redis_url == "redis://127.0.0.1:6400/0"


def test_each_envoy_of_the_per_zone_layout_is_a_part_discovery_hosts_can_place() -> None:
    hosts = {"envoy": "edge-host", "envoy-zone-a": "a-host", "envoy-zone-b": "b-host"}
    spec = resolve(
        MeshSpec.model_validate({"proxy": {"layout": "per_zone"}, "discovery": {"hosts": hosts}})
    )
    assert spec.edge_address.startswith("edge-host:")
    assert spec.mesh_address_for("zone-a").startswith("a-host:")
    assert spec.mesh_address_for("zone-b").startswith("b-host:")
    assert spec.proxy_stats_address("zone-b").startswith("b-host:")
    # In the shared layout there is no zone Envoy to place.
    with pytest.raises(ValueError, match=r"discovery.hosts: names no instance, Envoy"):
        MeshSpec.model_validate(
            {"proxy": {"layout": "shared"}, "discovery": {"hosts": {"envoy-zone-a": "a-host"}}}
        )


def test_the_small_host_profile_runs_one_feature_and_one_model_process_for_every_zone() -> None:
    spec = parse_spec("profile: small-host\n")
    assert spec.proxy.layout == "shared"
    assert [(i.name, i.zone) for i in spec.instances()] == [
        ("registry-0", "zone-a"),
        ("model-fraud-zone-a-0", "zone-a"),
        ("feature-zone-a-0", "zone-a"),
        ("gateway-zone-a-0", "zone-a"),
        ("gateway-zone-b-0", "zone-b"),
    ]
    # The zones stay: each keeps its gateway and its mesh listener.
    assert spec.zones == ["zone-a", "zone-b"]
    assert set(resolve(spec).mesh_ports) == {"zone-a", "zone-b"}
    # Written out and read back, it is the same spec.
    assert parse_spec(dump_spec(spec)) == spec


def test_a_profile_fills_only_what_the_spec_leaves_out() -> None:
    text = (
        "profile: small-host\nzones: [east, west]\nproxy: {layout: per_zone}\n"
        "model_servers: {per_zone: {east: 2}}\n"
    )
    spec = parse_spec(text)
    assert spec.proxy.layout == "per_zone"  # the spec's own
    assert spec.model_servers.per_zone == {"east": 2}  # the spec's own
    assert spec.feature.per_zone == {"east": 1}  # the profile's, in the first zone
    assert spec.gateway.per_zone == {"east": 1, "west": 1}  # a gateway in every zone
    # The default profile follows the spec's zones too.
    assert parse_spec("zones: [east, west]\n").model_servers.per_zone == {"east": 1, "west": 1}


def test_a_small_host_spec_that_puts_a_model_server_in_another_zone_is_refused() -> None:
    text = "profile: small-host\nmodel_servers: {per_zone: {zone-a: 1, zone-b: 1}}\n"
    with pytest.raises(SpecError) as err:
        parse_spec(text, "<small>")
    message = str(err.value)
    assert "model_servers.per_zone" in message and "['zone-b']" in message
    assert "profile: default" in message


def test_with_profile_moves_a_spec_between_profiles_and_back() -> None:
    small = with_profile(MeshSpec(), "small-host")
    assert small.profile == "small-host" and small.feature.per_zone == {"zone-a": 1}
    assert with_profile(small, "default") == MeshSpec()
