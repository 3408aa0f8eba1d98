"""`discovery.backend: dns` on a real mesh: every service is looked up under `localhost`
(each instance at its own port), Envoy resolves the names itself, no endpoint file exists,
Predicts answer through the edge, and a model server killed by PID is routed around while
DNS still lists it (health checks eject it) and taken back once the supervisor restarts it.
A mesh of this module's own."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from servemesh.contract.wire import model_cluster
from servemesh.identity import dial_edge
from servemesh.launcher import Mesh
from servemesh.proxy.apply import RouteManager
from servemesh.proxy.replicas import envoy_hosts
from servemesh.spec import MeshSpec
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import test_mesh_spec
from tests.waiting import wait_until

# Generous for a busy machine: a model server starts again within seconds.
BACK_WITHIN_S = 90.0
_KINDS = ("registry", "model", "feature", "gateway")


@pytest.fixture(scope="module")
def dns_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    base = test_mesh_spec(str(tmp_path_factory.mktemp("dns-mesh")))
    discovery = {"backend": "dns", "dns_names": dict.fromkeys(_KINDS, "localhost")}
    spec = MeshSpec.model_validate(base.model_dump(mode="json") | {"discovery": discovery})
    with Mesh.from_spec(spec) as running:
        yield running


def _predict(stub: gateway_pb2_grpc.GatewayStub, entity: int) -> bool:
    request = gateway_pb2.PredictRequest(model="fraud", entity_ids=[f"user-{entity % 400}"])
    try:
        stub.Predict(request, timeout=5)
    except grpc.RpcError:
        return False
    return True


def test_envoy_resolves_the_names_itself_and_no_endpoint_file_is_written(
    dns_mesh: Mesh,
) -> None:
    spec = dns_mesh.spec
    for proxy in spec.proxies():
        layout = dns_mesh.paths.xds_of(proxy)
        assert not list((layout.root / "eds").glob("*.yaml")), proxy
        clusters = yaml.safe_load(layout.cds.read_text())["resources"]
        services = [c for c in clusters if "cluster_type" in c]
        assert services, proxy
        assert all(c["cluster_type"]["name"] == "envoy.cluster.dns" for c in services)
    hosts = envoy_hosts(RouteManager(dns_mesh.paths))
    for zone in spec.zones:
        listed = hosts[model_cluster("fraud", "v1", zone)]
        for name in dns_mesh.pids_of("model"):
            assert listed[f"localhost:{spec.port_of(name)}"].healthy
            assert listed[f"127.0.0.1:{spec.port_of(name)}"].healthy


def test_a_killed_model_server_is_routed_around_while_dns_lists_it_then_taken_back(
    dns_mesh: Mesh,
) -> None:
    spec = dns_mesh.spec
    victim = sorted(dns_mesh.pids_of("model", spec.zones[0]))[0]
    address = "{}:{}".format(*spec.endpoint_of(victim))
    assert address.startswith("localhost:")
    cluster = model_cluster("fraud", "v1", spec.zones[0])
    manager = RouteManager(dns_mesh.paths)

    def state() -> tuple[bool, bool]:
        """(listed, healthy) of the victim in its zone's cluster, as Envoy sees it."""
        found = envoy_hosts(manager).get(cluster, {}).get(address)
        return found is not None, found is not None and found.healthy

    with dial_edge(spec).channel() as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        assert all(_predict(stub, i) for i in range(20))
        old = dns_mesh.pid(victim)
        os.kill(old, signal.SIGKILL)  # a crash: nothing tells Envoy or DNS
        wait_until(lambda: state() == (True, False), f"Envoy ejects {victim} ({address})")
        # Still listed (the name resolves), unhealthy: every Predict goes elsewhere.
        answered = [_predict(stub, i) for i in range(40)]
        assert all(answered), f"{answered.count(False)} of 40 Predicts failed"
        wait_until(
            lambda: dns_mesh.is_running(victim) and dns_mesh.pid(victim) != old,
            f"{victim} started again by the supervisor",
            timeout_s=BACK_WITHIN_S,
        )
        wait_until(
            lambda: state() == (True, True),
            f"Envoy counts {victim} healthy again",
            timeout_s=BACK_WITHIN_S,
        )
        assert all(_predict(stub, i) for i in range(20))


def test_the_mesh_refuses_what_would_edit_endpoint_files(
    dns_mesh: Mesh, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from servemesh.cli import main

    state = ["--state-dir", str(dns_mesh.state_dir)]
    assert main(["scale", "run", *state]) != 0
    assert "discovery.backend 'dns'" in capsys.readouterr().err
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(dns_mesh.resolved_spec_path.read_text())
    assert main(["control-plane", "--spec", str(resolved)]) != 0
    assert "discovery.backend: dns" in capsys.readouterr().err
