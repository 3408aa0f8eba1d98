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

A caller's sampled flag is honoured only within a budget at the edge. Any caller could
otherwise force every call's spans into the trace store, and nothing later can stop it:
Envoy takes its tracing decision before any HTTP filter runs, and a route's
`random_sampling` has no effect on 1.40 (the tracer's own sampler decides). So every edge
route gets a twin just before it (`with_forced_trace_routes`) that matches a
`traceparent` the tracer reads as sampled and carries the per-route buckets of a
dedicated local rate limit filter (`forced_traces_filter`, inert elsewhere): one per
client address and one overall (`tracing.forced_traces_*`). A call past it gets
RESOURCE_EXHAUSTED before any service sees it, leaving only the edge's own span (recorded
before the filter ran). Calls without a traceparent, or with an unsampled one, never
match the twin.
"""

from __future__ import annotations

import copy
import ipaddress
from typing import Any

from servemesh.contract.wire import TRACE_COLLECTOR_CLUSTER, envoy_trace_service
from servemesh.spec import MeshSpec, ResolvedSpec, TracingSpec

_OTEL_CONFIG = "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig"
_SAMPLERS = "type.googleapis.com/envoy.extensions.tracers.opentelemetry.samplers.v3."
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
# An export slower than this is dropped: spans must never hold Envoy's memory.
_EXPORT_TIMEOUT = "1s"


def _collector(spec: MeshSpec) -> tuple[str, int] | None:
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


def collector_is_named(spec: MeshSpec) -> bool:
    """Whether the collector is a host name for Envoy to resolve (not an address)."""
    found = _collector(spec)
    if found is None:
        return False
    try:
        ipaddress.ip_address(found[0])
    except ValueError:
        return True
    return False


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


# --- the forced-trace budget at the edge -------------------------------------------------

# The edge's own local rate limit instance for forced traces: inert on every route but the
# sampled-traceparent copies, which carry its buckets in their per-route config.
FORCED_TRACES_FILTER = "servemesh.forced_traces"
_RATE_LIMIT = "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
# Every `traceparent` Envoy's tracer reads as sampled, and a few more. Its parser takes
# exactly 55 characters of hex and dashes in any case and version, sampled when the last
# hex digit is odd; of several traceparent headers it reads the one a header matcher sees
# first, the matcher seeing them joined by commas (tests/tracing/test_forced_sampling.py
# holds the two to agreeing). So: the first comma-free value ends in an odd hex digit.
# (A pattern spelling out every field is over RE2's program size limit in Envoy; a looser
# match is harmless, a call it takes that forces nothing is only ever shed past the
# budget, and an unsampled `-00` never matches.)
SAMPLED_TRACEPARENT = r"^[^,]*[13579bdfBDF](,.*)?$"
_SAMPLED_MATCH = {
    "name": "traceparent",
    "string_match": {"safe_regex": {"regex": SAMPLED_TRACEPARENT}},
}
# A per-address bucket forgets its least recent caller past this many (it starts again
# full): a flood from more addresses than this is held by the overall bucket alone.
_MAX_CALLERS = 10_000


def _bucket(per_second: int, burst: int) -> dict[str, Any]:
    # Ten fills a second; below 10 a second one fill a second (the per-caller bucket's
    # interval must be a multiple of the overall bucket's).
    if per_second < 10:
        return {"max_tokens": burst, "tokens_per_fill": per_second, "fill_interval": "1s"}
    return {"max_tokens": burst, "tokens_per_fill": per_second // 10, "fill_interval": "0.100s"}


def _budget(tracing: TracingSpec) -> dict[str, Any]:
    """The forced-trace buckets: one per caller address, and one for everyone together;
    a call takes a token from both."""
    per_caller = _bucket(
        min(tracing.forced_traces_per_caller_per_second, tracing.forced_traces_per_second),
        min(tracing.forced_traces_per_caller_burst, tracing.forced_traces_burst),
    )
    return {
        "@type": _RATE_LIMIT,
        "stat_prefix": "edge_forced_traces",
        "token_bucket": _bucket(tracing.forced_traces_per_second, tracing.forced_traces_burst),
        "rate_limits": [{"actions": [{"remote_address": {}}]}],
        "descriptors": [
            {"entries": [{"key": "remote_address", "value": ""}], "token_bucket": per_caller}
        ],
        "max_dynamic_descriptors": _MAX_CALLERS,
        "always_consume_default_token_bucket": True,
        "filter_enabled": {
            "runtime_key": "edge_forced_traces.enabled",
            "default_value": {"numerator": 100, "denominator": "HUNDRED"},
        },
        "filter_enforced": {
            "runtime_key": "edge_forced_traces.enforced",
            "default_value": {"numerator": 100, "denominator": "HUNDRED"},
        },
        "rate_limited_as_resource_exhausted": True,
    }


def forced_traces_filter(spec: MeshSpec) -> dict[str, Any] | None:
    """The edge's forced-trace filter (None when tracing is off): no bucket of its own, so
    it passes every call on a route that does not name it."""
    if _collector(spec) is None:
        return None
    return {
        "name": FORCED_TRACES_FILTER,
        "typed_config": {"@type": _RATE_LIMIT, "stat_prefix": "edge_forced_traces"},
    }


def with_forced_trace_routes(spec: MeshSpec, routes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each edge route preceded by its twin for calls with a sampled `traceparent`: the same
    match and action, held to the forced-trace budget. Unchanged when tracing is off."""
    if _collector(spec) is None:
        return routes
    out: list[dict[str, Any]] = []
    for route in routes:
        forced = copy.deepcopy(route)
        forced["name"] = f"{route['name']}-forced-trace"
        forced["match"].setdefault("headers", []).append(copy.deepcopy(_SAMPLED_MATCH))
        forced.setdefault("typed_per_filter_config", {})[FORCED_TRACES_FILTER] = _budget(
            spec.tracing
        )
        out += [forced, route]
    return out
