"""The Envoy config rendered from the spec: accepted by Envoy, and saying what we mean."""

from __future__ import annotations

from pathlib import Path

import pytest

from servemesh.proxy.process import EnvoyConfigError, validate_config
from servemesh.proxy.render import render_bootstrap, write_bootstrap
from servemesh.spec import MeshSpec, ModelSpec, resolve_ports


def _spec(**overrides: object) -> MeshSpec:
    return resolve_ports(
        MeshSpec(ports={"edge": 0, "mesh": 0, "envoy_admin": 0, "services_base": 0}, **overrides)
    )


def _routes(config: dict, listener: str) -> list[dict]:
    [found] = [x for x in config["static_resources"]["listeners"] if x["name"] == listener]
    hcm = found["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["route_config"]["virtual_hosts"][0]["routes"]


def test_default_spec_renders_a_config_envoy_accepts(tmp_path: Path) -> None:
    validate_config(write_bootstrap(_spec(), tmp_path / "envoy.yaml", tmp_path))


def test_envoy_rejects_a_broken_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("static_resources: {clusters: [{name: x, type: NOPE}]}\n")
    with pytest.raises(EnvoyConfigError):
        validate_config(bad)


def test_model_routes_pin_versions_and_split_the_rest_by_weight(tmp_path: Path) -> None:
    spec = _spec(models={"fraud": ModelSpec(traffic={"v1": 90, "v2": 10})})
    routes = _routes(render_bootstrap(spec, tmp_path), "mesh")
    names = [r["name"] for r in routes]
    # Pinned routes must come before the split, or the split would swallow pinned calls.
    assert names.index("fraud-v1-pinned") < names.index("fraud-split")
    split = next(r for r in routes if r["name"] == "fraud-split")["route"]["weighted_clusters"][
        "clusters"
    ]
    assert {(c["name"], c["weight"]) for c in split} == {
        ("model-fraud-v1", 90),
        ("model-fraud-v2", 10),
    }
    assert all(c["request_headers_to_add"][0]["header"]["value"] in {"v1", "v2"} for c in split)


def test_grpc_routes_honour_caller_deadlines_and_retry_killed_upstreams(tmp_path: Path) -> None:
    routes = _routes(render_bootstrap(_spec(), tmp_path), "mesh")
    split = next(r for r in routes if r["name"] == "fraud-split")["route"]
    assert split["timeout"] == "0s"
    assert split["max_stream_duration"]["grpc_timeout_header_max"] == "0s"
    retry_on = set(split["retry_policy"]["retry_on"].split(","))
    assert {"connect-failure", "reset", "refused-stream", "unavailable"} <= retry_on


def test_every_cluster_has_active_grpc_health_checks_with_a_short_no_traffic_interval(
    tmp_path: Path,
) -> None:
    clusters = render_bootstrap(_spec(), tmp_path)["static_resources"]["clusters"]
    assert {c["name"] for c in clusters} >= {
        "gateway",
        "feature",
        "registry",
        "model-fraud-v1",
        "model-fraud-v2",
    }
    for cluster in clusters:
        [check] = cluster["health_checks"]
        assert "grpc_health_check" in check and check["no_traffic_interval"] == "1.000s"
        zones = {ep["locality"]["zone"] for ep in cluster["load_assignment"]["endpoints"]}
        assert zones <= {"zone-a", "zone-b"}


def test_the_committed_example_config_is_what_the_default_spec_renders() -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    rendered = subprocess.run(
        [sys.executable, "-m", "servemesh", "envoy-config", "--spec", "mesh.yaml"],
        cwd=repo, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert rendered == (repo / "envoy" / "mesh-default.yaml").read_text(), (
        "refresh with: servemesh envoy-config --spec mesh.yaml > envoy/mesh-default.yaml"
    )
