"""Envoy's stats listener serves GET /stats/prometheus and nothing else of the admin API."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from servemesh.launcher import Mesh


def _get(url: str, method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_stats_listener_serves_envoy_metrics(metrics_mesh: Mesh) -> None:
    spec = metrics_mesh.spec
    status, body = _get(f"http://{spec.envoy_stats_address}/stats/prometheus")
    assert status == 200
    assert "envoy_cluster_upstream_rq_total" in body
    assert 'envoy_cluster_name="gateway"' in body
    # Each zone's clusters are counted by the Envoy that holds them, on its own listener.
    zone_a = spec.proxy_stats_address(spec.proxy_of_zone("zone-a"))
    status, body = _get(f"http://{zone_a}/stats/prometheus")
    assert status == 200
    assert 'envoy_cluster_name="model-fraud-v1-via-zone-a"' in body


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/quitquitquit", "POST"),
        ("/runtime_modify?x=1", "POST"),
        ("/stats?format=json", "GET"),
        ("/config_dump", "GET"),
        ("/stats/prometheus", "POST"),
        ("/stats/prometheus/../../quitquitquit", "POST"),
        ("/healthcheck/fail", "POST"),
    ],
)
def test_everything_else_of_the_admin_api_is_refused(
    metrics_mesh: Mesh, path: str, method: str
) -> None:
    status, _ = _get(f"http://{metrics_mesh.spec.envoy_stats_address}{path}", method)
    assert status == 404
    # Envoy is still serving: the stats listener answers as before.
    ok, _ = _get(f"http://{metrics_mesh.spec.envoy_stats_address}/stats/prometheus")
    assert ok == 200
