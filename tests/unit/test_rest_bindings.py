"""The REST bindings at the edge (google.api.http options, read by Envoy's transcoder from
the descriptor set the mesh builds): exactly the calls docs/rest.md lists, never a control
call (the edge's refusal of control calls runs before the transcoder, so a binding to one
would dodge it), and the descriptor set holds every file they import."""

from __future__ import annotations

from google.api import annotations_pb2, http_pb2  # type: ignore[import-untyped]
from google.protobuf import descriptor_pb2

from servemesh.contract.wire import CONTROL_METHODS, method_path
from servemesh.proxy.transcoder import REST_SERVICES, descriptor_set


def bindings() -> dict[str, list[tuple[str, str]]]:
    """Method path -> (verb, path) of every binding, additional ones included."""
    found: dict[str, list[tuple[str, str]]] = {}
    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set())
    for file in files.file:
        for service in file.service:
            full = f"{file.package}.{service.name}"
            for method in service.method:
                rule = method.options.Extensions[annotations_pb2.http]
                rules = [rule, *rule.additional_bindings] if rule.WhichOneof("pattern") else []
                for each in rules:
                    verb = each.WhichOneof("pattern")
                    if verb is not None:
                        path = getattr(each, verb)
                        found.setdefault(method_path(full, method.name), []).append((verb, path))
    return found


def test_the_bindings_are_the_documented_paths_and_no_control_call() -> None:
    found = bindings()
    assert not set(found) & set(CONTROL_METHODS), sorted(set(found) & set(CONTROL_METHODS))
    assert found == {
        "/servemesh.gateway.v1.Gateway/Predict": [("post", "/v1/models/{model}:predict")],
        "/inference.GRPCInferenceService/ServerLive": [("get", "/v2/health/live")],
        "/inference.GRPCInferenceService/ServerReady": [("get", "/v2/health/ready")],
        "/inference.GRPCInferenceService/ServerMetadata": [("get", "/v2")],
        "/inference.GRPCInferenceService/ModelReady": [
            ("get", "/v2/models/{name}/ready"),
            ("get", "/v2/models/{name}/versions/{version}/ready"),
        ],
        "/inference.GRPCInferenceService/ModelMetadata": [
            ("get", "/v2/models/{name}"),
            ("get", "/v2/models/{name}/versions/{version}"),
        ],
        "/inference.GRPCInferenceService/ModelInfer": [
            ("post", "/v2/models/{model_name}/infer"),
            ("post", "/v2/models/{model_name}/versions/{model_version}/infer"),
        ],
    }
    assert {path.split("/")[1] for path in found} == set(REST_SERVICES)


def test_the_descriptor_set_holds_every_import_before_its_importer() -> None:
    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set()).file
    seen: set[str] = set()
    for file in files:
        assert set(file.dependency) <= seen, (file.name, file.dependency)
        seen.add(file.name)
    assert http_pb2.DESCRIPTOR.name in seen
