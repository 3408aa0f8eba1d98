"""A model replica that unloads its routed version fails Envoy's health check and is routed
around; loading the version back brings it into rotation again.

The version's own clusters check the version's health, the model-servers clusters the
replica's overall health (NOT_SERVING while a routed version is missing); the clusters of
the versions it still holds keep it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from servemesh.contract.control_credential import control_metadata_for
from servemesh.contract.wire import model_cluster, model_servers_cluster
from servemesh.identity import dial_edge, dial_service
from servemesh.launcher import Mesh
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from tests.mesh.envoys import EveryEnvoy
from tests.waiting import wait_until

VICTIM = "model-fraud-zone-a-0"
OTHER = "model-fraud-zone-b-0"
ROUTED = "v1"  # weight 100 in the test mesh's spec


def _version() -> dict[str, oip.ModelRepositoryParameter]:
    return {"version": oip.ModelRepositoryParameter(string_param=ROUTED)}


def _hosts_of(admin: EveryEnvoy, address: str) -> dict[str, bool]:
    """Whether each cluster holding `address` calls that host healthy."""
    return {
        name: host.healthy
        for name, cluster in admin.clusters().items()
        for host in cluster.hosts
        if host.address == address
    }


def _every_cluster(
    admin: EveryEnvoy, address: str, *, healthy: bool, where: tuple[str, ...] = ("",)
) -> dict[str, bool] | None:
    """The host's health per cluster once every cluster holding it whose name starts with
    one of `where` agrees on `healthy`."""
    seen = {n: h for n, h in _hosts_of(admin, address).items() if n.startswith(where)}
    return seen if seen and all(value == healthy for value in seen.values()) else None


# The clusters that lose the replica: the routed version's, and any-model-server's.
LOSING = (model_cluster("fraud", ROUTED, ""), model_servers_cluster(""))
# The clusters of a version it still holds keep it.
KEEPING = (model_cluster("fraud", "v2", ""),)


@pytest.fixture
def victim(mesh: Mesh) -> Iterator[grpc_service_pb2_grpc.GRPCInferenceServiceStub]:
    """An OIP stub straight to VICTIM's port; its routed version is loaded again after."""
    with dial_service(mesh.spec, VICTIM).channel() as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            yield stub
        finally:
            ready = stub.ModelReady(oip.ModelReadyRequest(name="fraud", version=ROUTED), timeout=5)
            if not ready.ready:
                stub.RepositoryModelLoad(
                    oip.RepositoryModelLoadRequest(model_name="fraud", parameters=_version()),
                    timeout=120,
                    metadata=control_metadata_for(mesh.state_dir),
                )


def test_replica_missing_its_routed_version_is_taken_out_by_envoy_health_checks(
    mesh: Mesh, victim: grpc_service_pb2_grpc.GRPCInferenceServiceStub
) -> None:
    admin = EveryEnvoy(mesh)
    address = f"{mesh.spec.host}:{mesh.spec.port_of(VICTIM)}"
    wait_until(
        lambda: _every_cluster(admin, address, healthy=True),
        f"{VICTIM} healthy in every cluster before the test",
    )

    victim.RepositoryModelUnload(
        oip.RepositoryModelUnloadRequest(model_name="fraud", parameters=_version()),
        timeout=10,
        metadata=control_metadata_for(mesh.state_dir),
    )
    wait_until(
        lambda: _every_cluster(admin, address, healthy=False, where=LOSING),
        f"Envoy to mark {VICTIM} unhealthy in the {ROUTED} and model-servers clusters",
    )
    assert _every_cluster(admin, address, healthy=True, where=KEEPING)
    with dial_edge(mesh.spec).channel() as channel:
        gateway = gateway_pb2_grpc.GatewayStub(channel)
        answers = [
            gateway.Predict(
                gateway_pb2.PredictRequest(model="fraud", entity_ids=[f"user-{i}"]), timeout=5
            )
            for i in range(40)
        ]
    assert {(a.model_replica, a.model_version, a.degraded) for a in answers} == {
        (OTHER, ROUTED, False)
    }

    victim.RepositoryModelLoad(
        oip.RepositoryModelLoadRequest(model_name="fraud", parameters=_version()),
        timeout=120,
        metadata=control_metadata_for(mesh.state_dir),
    )
    wait_until(
        lambda: _every_cluster(admin, address, healthy=True),
        f"Envoy to mark {VICTIM} healthy again in every cluster",
    )
