"""On a running mesh, every control call needs the mesh's control credential, at each
service's own port: without it UNAUTHENTICATED, with a wrong one PERMISSION_DENIED, and
nothing changes; with it the call works. The token itself is owner-only and in no log."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.control_credential import (
    Metadata,
    control_metadata,
    control_metadata_for,
    control_token_path,
    read_control_token,
)
from servemesh.contract.demo import DEMO_FEATURES
from servemesh.contract.wire import (
    CONTROL_METHODS,
    FEATURE_SERVICE,
    LOAD_VERSION_PARAMETER,
    OIP_SERVICE,
    REGISTRY_SERVICE,
    method_path,
    version_health_name,
)
from servemesh.identity import dial_service
from servemesh.launcher import Mesh
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc
from servemesh_api.registry.v1 import registry_pb2 as pb
from servemesh_api.registry.v1 import registry_pb2_grpc

MISSING = "control call: this method needs the mesh's control credential"
WRONG: Metadata = control_metadata("a-token-of-another-mesh")
ENTITY = "user-1"


def _version(version: str) -> dict[str, oip.ModelRepositoryParameter]:
    return {LOAD_VERSION_PARAMETER: oip.ModelRepositoryParameter(string_param=version)}


def _first(mesh: Mesh, service: str) -> str:
    return next(i.name for i in mesh.spec.instances() if i.service == service)


@pytest.fixture
def channels(mesh: Mesh) -> Iterator[dict[str, grpc.Channel]]:
    """Plain channels straight to one registry, model server and feature service."""
    opened = {
        service: dial_service(mesh.spec, _first(mesh, service)).channel()
        for service in ("registry", "model", "feature")
    }
    try:
        yield opened
    finally:
        for channel in opened.values():
            channel.close()


def _calls(channels: dict[str, grpc.Channel]) -> dict[str, Callable[[Metadata], object]]:
    """Each control method, called with the metadata given: each would change the mesh."""
    registry = registry_pb2_grpc.RegistryStub(channels["registry"])
    model = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channels["model"])
    features = feature_pb2_grpc.FeatureServiceStub(channels["feature"])
    data = b"\x00" * 64

    def upload() -> Iterator[pb.UploadVersionRequest]:
        yield pb.UploadVersionRequest(
            header=pb.UploadHeader(
                model="fraud",
                version="v99",
                sha256=hashlib.sha256(data).hexdigest(),
                size_bytes=len(data),
                format="torchscript",
            )
        )
        yield pb.UploadVersionRequest(chunk=data)

    def load_rows() -> Iterator[feature_pb2.LoadFeaturesRequest]:
        yield feature_pb2.LoadFeaturesRequest(
            header=feature_pb2.LoadHeader(
                view="user", feature_names=list(DEMO_FEATURES), source="intruder"
            )
        )
        values = np.zeros((1, len(DEMO_FEATURES)), dtype="<f4")
        yield feature_pb2.LoadFeaturesRequest(
            chunk=feature_pb2.LoadChunk(entity_ids=["intruder"], values=values.tobytes())
        )
        yield feature_pb2.LoadFeaturesRequest(commit=feature_pb2.LoadCommit(rows=1))

    return {
        method_path(REGISTRY_SERVICE, "CreateModel"): lambda md: registry.CreateModel(
            pb.CreateModelRequest(name="intruder"), metadata=md, timeout=10
        ),
        method_path(REGISTRY_SERVICE, "UploadVersion"): lambda md: registry.UploadVersion(
            upload(), metadata=md, timeout=10
        ),
        method_path(REGISTRY_SERVICE, "SetAlias"): lambda md: registry.SetAlias(
            pb.SetAliasRequest(model="fraud", alias="production", version="v2"),
            metadata=md,
            timeout=10,
        ),
        method_path(OIP_SERVICE, "RepositoryModelLoad"): lambda md: model.RepositoryModelLoad(
            oip.RepositoryModelLoadRequest(model_name="fraud", parameters=_version("v2")),
            metadata=md,
            timeout=120,
        ),
        method_path(OIP_SERVICE, "RepositoryModelUnload"): (
            lambda md: model.RepositoryModelUnload(
                oip.RepositoryModelUnloadRequest(model_name="fraud"), metadata=md, timeout=30
            )
        ),
        method_path(FEATURE_SERVICE, "WriteFeatures"): lambda md: features.WriteFeatures(
            feature_pb2.WriteFeaturesRequest(
                view="user",
                entities=[
                    feature_pb2.EntityFeatures(
                        entity_id=ENTITY, values={name: 0.0 for name in DEMO_FEATURES}
                    )
                ],
            ),
            metadata=md,
            timeout=10,
        ),
        method_path(FEATURE_SERVICE, "LoadFeatures"): lambda md: features.LoadFeatures(
            load_rows(), metadata=md, timeout=30
        ),
    }


def _state(mesh: Mesh, channels: dict[str, grpc.Channel]) -> tuple[object, ...]:
    """What the control calls above could change: the registry's models and fraud's
    versions, what the replica serves, and a demo entity's features."""
    registry = registry_pb2_grpc.RegistryStub(channels["registry"])
    models = registry.ListModels(pb.ListModelsRequest(), timeout=10)
    versions = registry.ListVersions(pb.ListVersionsRequest(model="fraud"), timeout=10)
    model = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channels["model"])
    index = model.RepositoryIndex(oip.RepositoryIndexRequest(), timeout=10)
    health = health_pb2_grpc.HealthStub(channels["model"])
    fraud_v1 = health.Check(
        health_pb2.HealthCheckRequest(service=version_health_name("fraud", "v1")), timeout=10
    )
    features = feature_pb2_grpc.FeatureServiceStub(channels["feature"])
    row = features.GetFeatures(
        feature_pb2.GetFeaturesRequest(
            view="user", entity_ids=[ENTITY], feature_names=list(DEMO_FEATURES)
        ),
        timeout=10,
    )
    return (
        sorted((m.name, sorted(m.aliases.items())) for m in models.models),
        sorted(v.version for v in versions.versions),
        sorted((m.name, m.version, m.state) for m in index.models),
        fraud_v1.status,
        [list(v.values) for v in row.vectors],
    )


CALLS = sorted(CONTROL_METHODS)


def test_every_control_method_is_exercised_here(channels: dict[str, grpc.Channel]) -> None:
    assert sorted(_calls(channels)) == CALLS


@pytest.mark.parametrize("method", CALLS, ids=[m.rpartition("/")[2] for m in CALLS])
def test_a_control_call_without_the_credential_changes_nothing(
    mesh: Mesh, channels: dict[str, grpc.Channel], method: str
) -> None:
    before = _state(mesh, channels)
    call = _calls(channels)[method]
    with pytest.raises(grpc.RpcError) as missing:
        call(())
    assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert missing.value.details() == MISSING
    with pytest.raises(grpc.RpcError) as wrong:
        call(WRONG)
    assert wrong.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _state(mesh, channels) == before


def test_the_unload_of_the_issue_leaves_fraud_loaded(
    mesh: Mesh, channels: dict[str, grpc.Channel]
) -> None:
    """The report that started this: an unload sent by any local process unloaded fraud.
    Now every replica refuses it, and fraud stays loaded and SERVING everywhere."""
    for replica in (i.name for i in mesh.spec.instances() if i.service == "model"):
        with dial_service(mesh.spec, replica).channel() as channel:
            stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.RepositoryModelUnload(
                    oip.RepositoryModelUnloadRequest(model_name="fraud"), timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(
                health_pb2.HealthCheckRequest(service=version_health_name("fraud", "v1")),
                timeout=10,
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_with_the_credential_a_load_works_and_a_version_outside_the_spec_is_refused(
    mesh: Mesh, channels: dict[str, grpc.Channel]
) -> None:
    credential = control_metadata_for(mesh.state_dir)
    model = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channels["model"])
    # fraud v2 is in the spec (no weight): reloading it is a control call that works.
    model.RepositoryModelLoad(
        oip.RepositoryModelLoadRequest(model_name="fraud", parameters=_version("v2")),
        metadata=credential,
        timeout=120,
    )
    # A version the spec does not name: the credential alone does not choose what runs.
    with pytest.raises(grpc.RpcError) as refused:
        model.RepositoryModelLoad(
            oip.RepositoryModelLoadRequest(model_name="fraud", parameters=_version("v99")),
            metadata=credential,
            timeout=30,
        )
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details()
    assert "fraud/v99" in details and "servemesh apply" in details
    index = model.RepositoryIndex(oip.RepositoryIndexRequest(), timeout=10)
    assert ("fraud", "v99") not in {(m.name, m.version) for m in index.models}


def test_the_token_is_owner_only_and_in_no_log(mesh: Mesh) -> None:
    path = control_token_path(mesh.state_dir)
    assert path.stat().st_mode & 0o777 == 0o600
    token = read_control_token(mesh.state_dir)
    assert token is not None and len(token) >= 32
    logs = [p for p in mesh.logs_dir.rglob("*") if p.is_file()]
    assert logs, "the mesh wrote no logs"
    leaked = [str(p) for p in logs if token.encode() in p.read_bytes()]
    assert leaked == []
    # Nor is it in the spec files the mesh wrote (which `servemesh` commands print).
    for written in (mesh.resolved_spec_path, mesh.envoy_config_path, mesh.endpoints_path):
        assert token not in written.read_text()
