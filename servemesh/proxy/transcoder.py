"""REST/JSON at the edge: Envoy's gRPC-JSON transcoder, configured from our own protos.

The edge's callers may speak HTTP/1.1 or HTTP/2 with JSON bodies instead of gRPC. The
transcoder filter turns such a request into the gRPC call its `google.api.http` binding
names (protos/servemesh_api: the gateway's Predict, the OIP server, model and infer calls),
and turns the gRPC answer back into JSON; no HTTP server of ours exists. It runs after the
edge's per-address limit, its refusal of control calls (no control method has a binding)
and its auth, which read headers and paths only, so a caller without credentials never
gets a body held or parsed; the per-caller limit and the route to the gateways then judge
a REST call as the gRPC call it became.

The descriptor set Envoy needs is built here, from the generated modules' own descriptors
(the bytes protoc compiled, with every file they import), and goes into the listener's
config inline: nothing to keep in step with the protos, and no file to mount where Envoy
runs in a container.

How errors come back (docs/rest.md): a body that is not JSON of the call's message: 400
with the parser's message; a path no binding matches: 404; a body over the edge's message
limit: 413; a gRPC status: its HTTP status (INVALID_ARGUMENT 400, UNAUTHENTICATED 401,
PERMISSION_DENIED 403, NOT_FOUND 404, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503,
DEADLINE_EXCEEDED 504) with a JSON google.rpc.Status body naming what was wrong.
"""

from __future__ import annotations

import base64
from functools import cache
from typing import Any

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

from servemesh.contract.wire import GATEWAY_SERVICE, OIP_SERVICE
from servemesh.spec import MeshSpec
from servemesh_api.gateway.v1 import gateway_pb2
from servemesh_api.inference import grpc_service_pb2

TRANSCODER_FILTER = "envoy.filters.http.grpc_json_transcoder"
BUFFER_FILTER = "envoy.filters.http.buffer"
_BUFFER = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
_BUFFER_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.BufferPerRoute"
# Anything but gRPC (application/grpc, +proto and the rest of its family): the transcoder
# takes a body of any other content type, or none, so each of them is held to the limit.
NOT_GRPC_MATCH = {
    "name": "content-type",
    "string_match": {"prefix": "application/grpc", "ignore_case": True},
    "invert_match": True,
    "treat_missing_header_as_empty": True,
}
_TRANSCODER = (
    "type.googleapis.com/envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder"
)
# The services whose bindings the edge serves (their methods' `google.api.http` options).
REST_SERVICES = (GATEWAY_SERVICE, OIP_SERVICE)


def _with_imports(files: tuple[FileDescriptor, ...]) -> list[FileDescriptor]:
    """`files` and everything they import, each once, imports first (Envoy builds its pool
    in order and refuses a file whose import it has not seen)."""
    ordered: list[FileDescriptor] = []
    seen: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in seen:
            return
        seen.add(file.name)
        for imported in file.dependencies:
            add(imported)
        ordered.append(file)

    for file in files:
        add(file)
    return ordered


@cache
def descriptor_set() -> bytes:
    """The FileDescriptorSet of the REST services' protos and their imports."""
    found = descriptor_pb2.FileDescriptorSet()
    for file in _with_imports((gateway_pb2.DESCRIPTOR, grpc_service_pb2.DESCRIPTOR)):
        proto = found.file.add()
        file.CopyToProto(proto)
    return found.SerializeToString()


def transcoder_filter(spec: MeshSpec) -> dict[str, Any]:
    """The edge's transcoder: our REST bindings, field names as in the protos, every field
    printed (a false `ready` or a zero score is an answer, not an absence), unknown paths
    and query parameters refused, and bodies held to the edge's message limit."""
    limit = spec.limits.max_message_bytes
    return {
        "name": TRANSCODER_FILTER,
        "typed_config": {
            "@type": _TRANSCODER,
            "proto_descriptor_bin": base64.b64encode(descriptor_set()).decode(),
            "services": list(REST_SERVICES),
            "print_options": {
                "always_print_primitive_fields": True,
                "preserve_proto_field_names": True,
            },
            # A gRPC status comes back as HTTP status plus a google.rpc.Status JSON body.
            "convert_grpc_status": True,
            "request_validation_options": {
                "reject_unknown_method": True,
                "reject_unknown_query_parameters": True,
            },
            "max_request_body_size": limit,
            "max_response_body_size": limit,
        },
    }


def json_body_limit_filter(spec: MeshSpec) -> dict[str, Any]:
    """A JSON body over the edge's message limit is refused with 413 before it is parsed.
    The transcoder alone turns the body into one gRPC message as it arrives, so an
    oversized one would reach the gateway and come back 429 (RESOURCE_EXHAUSTED). Off by
    default: only the REST route enables it (`json_route`), so gRPC streams through the
    edge are never held in a buffer, and gRPC callers keep their own status for a message
    too large."""
    return {
        "name": BUFFER_FILTER,
        "disabled": True,
        "typed_config": {"@type": _BUFFER, "max_request_bytes": spec.limits.max_message_bytes},
    }


def json_route(spec: MeshSpec, action: dict[str, Any]) -> dict[str, Any]:
    """The edge route a REST call matches before it is transcoded (any content type but
    gRPC's): its body limited (json_body_limit_filter, enabled by this route's config of
    it). Once transcoded it is a gRPC call, matched again against the edge's other routes."""
    limit = {
        "@type": _BUFFER_PER_ROUTE,
        "buffer": {"max_request_bytes": spec.limits.max_message_bytes},
    }
    return {
        "name": "rest-json",
        "match": {"prefix": "/", "headers": [NOT_GRPC_MATCH]},
        "route": action,
        "typed_per_filter_config": {BUFFER_FILTER: limit},
    }
