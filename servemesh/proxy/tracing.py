"""Envoy's own spans: the OpenTelemetry tracer on every listener, and its collector cluster.

Each HTTP connection manager gets a `tracing` block whose spans join the W3C trace of the
request (Envoy reads and writes `traceparent`) and leave over OTLP/gRPC through the
`trace_collector` cluster, which points at the spec's `tracing.otlp_endpoint` (the
embedded trace store unless the spec names a collector). Sampling follows the services'
policy: a request carrying a `traceparent` keeps its sampled flag, one without starts a
new trace at `tracing.sample_ratio`.

That takes the tracer's own sampler (parent-based around a trace-id ratio), with the
connection manager's `random_sampling` at 100%: Envoy 1.40 records a span only when both
its connection manager and the span say so, and with `random_sampling` at the ratio a
caller's sampled `traceparent` was dropped unless the dice agreed (measured: a forced
trace at ratio 0 had no Envoy span, and no service span after the edge either).

Envoy's tracer sends its spans every `tracing.opentelemetry.flush_interval_ms` (a runtime
key, 5 s unless set) or once 5 are waiting in a worker: a lone sampled request's Envoy
spans waited ~5 s, so the key takes the services' `export_interval_ms` (`tracer_runtime`).
"""

from __future__ import annotations

from typing import Any

from servemesh.spec import ResolvedSpec
from servemesh.wire import TRACE_COLLECTOR_CLUSTER, envoy_trace_service

_OTEL_CONFIG = "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig"
_SAMPLERS = "type.googleapis.com/envoy.extensions.tracers.opentelemetry.samplers.v3."
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
# An export slower than this is dropped: spans must never hold Envoy's memory.
_EXPORT_TIMEOUT = "1s"


def _collector(spec: ResolvedSpec) -> tuple[str, int] | None:
    endpoint = spec.tracing.otlp_endpoint
    if not spec.tracing.enabled or not endpoint:
        return None
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    return ("127.0.0.1" if host == "localhost" else host), int(port)


def hcm_tracing(spec: ResolvedSpec, listener: str) -> dict[str, Any]:
    """The HTTP connection manager's `tracing` entry for `listener` ({} when tracing is off)."""
    if _collector(spec) is None:
        return {}
    ratio = {
        "name": "envoy.tracers.opentelemetry.samplers.trace_id_ratio_based",
        "typed_config": {
            "@type": _SAMPLERS + "TraceIdRatioBasedSamplerConfig",
            "sampling_percentage": {
                "numerator": round(spec.tracing.sample_ratio * 1_000_000),
                "denominator": "MILLION",
            },
        },
    }
    return {
        "tracing": {
            # The tracer's sampler decides (module docstring).
            "random_sampling": {"value": 100.0},
            "provider": {
                "name": "envoy.tracers.opentelemetry",
                "typed_config": {
                    "@type": _OTEL_CONFIG,
                    "grpc_service": {
                        "envoy_grpc": {"cluster_name": TRACE_COLLECTOR_CLUSTER},
                        "timeout": _EXPORT_TIMEOUT,
                    },
                    "service_name": envoy_trace_service(listener),
                    "sampler": {
                        "name": "envoy.tracers.opentelemetry.samplers.parent_based",
                        "typed_config": {
                            "@type": _SAMPLERS + "ParentBasedSamplerConfig",
                            "wrapped_sampler": ratio,
                        },
                    },
                },
            },
        }
    }


def tracer_runtime(spec: ResolvedSpec) -> dict[str, int]:
    """Runtime keys for Envoy's static layer: its spans leave as often as the services'."""
    if _collector(spec) is None:
        return {}
    return {"tracing.opentelemetry.flush_interval_ms": spec.tracing.export_interval_ms}


def collector_cluster(spec: ResolvedSpec) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The collector's cluster (HTTP/2, no health checks: spans are best effort) and its
    endpoints; None when tracing is off."""
    found = _collector(spec)
    if found is None:
        return None
    host, port = found
    cluster = {
        "name": TRACE_COLLECTOR_CLUSTER,
        "connect_timeout": "0.25s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "type": "EDS",
    }
    endpoints = {
        "cluster_name": TRACE_COLLECTOR_CLUSTER,
        "endpoints": [
            {
                "lb_endpoints": [
                    {
                        "endpoint": {
                            "address": {"socket_address": {"address": host, "port_value": port}}
                        }
                    }
                ]
            }
        ],
    }
    return cluster, endpoints
