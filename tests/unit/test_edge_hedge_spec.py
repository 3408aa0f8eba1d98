"""`traffic.edge_hedge` as rendered: off by default; on, a route per idempotent read at the
edge, ahead of the catch-all, with the edge's retries, its per-try timeout as the hedge delay
and the edge's fault settings. (tests/mesh/test_edge_hedge.py runs it on a real Envoy.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from servemesh.proxy.render import HEDGED_EDGE_METHODS, render_resources
from servemesh.spec import MeshSpec, Ports, resolve
from servemesh.spec.policy import EdgeHedge, RetryPolicy, RoutePolicy, TrafficSpec


def _edge_routes(tmp_path: Path, traffic: TrafficSpec) -> list[dict[str, Any]]:
    spec = resolve(MeshSpec(ports=Ports.free(), state_dir=str(tmp_path), traffic=traffic))
    routes = render_resources(spec, tmp_path).route_configs["edge"]["virtual_hosts"][0]
    return list(routes["routes"])


def test_no_call_is_hedged_at_the_edge_by_default(tmp_path: Path) -> None:
    routes = _edge_routes(tmp_path, TrafficSpec())
    assert not [r for r in routes if "hedge_policy" in r.get("route", {})]
    assert not [r for r in routes if "per_try_timeout" in r["route"].get("retry_policy", {})]


def test_predict_and_model_infer_are_hedged_ahead_of_the_catch_all(tmp_path: Path) -> None:
    routes = _edge_routes(tmp_path, TrafficSpec(edge_hedge=EdgeHedge(after_ms=250)))
    names = [r["name"] for r in routes]
    hedged = [r for r in routes if "hedge_policy" in r["route"]]
    # Each read twice: its own route and its forced-trace twin.
    assert sorted(r["match"]["path"] for r in hedged) == sorted(HEDGED_EDGE_METHODS * 2)
    catch_all = names.index("gateway")
    for route in hedged:
        assert names.index(route["name"]) < catch_all
        assert route["route"]["hedge_policy"] == {"hedge_on_per_try_timeout": True}
        retry = route["route"]["retry_policy"]
        assert retry["per_try_timeout"] == "0.250s"
        assert retry["num_retries"] == 2 and "retry_host_predicate" in retry  # elsewhere
        fault = route["typed_per_filter_config"]["envoy.filters.http.fault"]
        assert fault == routes[catch_all]["typed_per_filter_config"]["envoy.filters.http.fault"]
    # Everything else at the edge stays unhedged, with no per-try timeout.
    others = [r for r in routes if r not in hedged and "retry_policy" in r["route"]]
    assert others and not [r for r in others if "per_try_timeout" in r["route"]["retry_policy"]]


def test_a_hedge_needs_a_retry_to_be_sent_as() -> None:
    no_retries = RoutePolicy(retries=RetryPolicy(num_retries=0, per_try_timeout_ms=0))
    with pytest.raises(ValidationError, match="edge_hedge.after_ms"):
        TrafficSpec(edge=no_retries, edge_hedge=EdgeHedge(after_ms=100))
