"""The mesh's Prometheus, read through its HTTP API: instant queries, targets, readiness."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from servemesh.contract.errors import ServemeshError


class PrometheusError(ServemeshError, RuntimeError):
    """Prometheus did not answer, or answered an error."""


class PromClient:
    """Instant queries against the Prometheus at `address` (host:port)."""

    def __init__(self, address: str, timeout_s: float = 5.0) -> None:
        self.address = address
        self.timeout_s = timeout_s

    def _get(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        url = f"http://{self.address}{path}{query}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:
                body = json.loads(reply.read())
        except (OSError, ValueError) as exc:
            raise PrometheusError(f"{url}: {exc}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{url}: {body.get('error', body)}")
        return body["data"]

    def ready(self) -> bool:
        """Prometheus answers /-/ready (its storage is open, it scrapes)."""
        try:
            url = f"http://{self.address}/-/ready"
            with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:
                return bool(reply.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant vector: (labels, value) per series; NaN values left out."""
        data = self._get("/api/v1/query", {"query": expr})
        found = []
        for series in data.get("result", []):
            value = float(series["value"][1])
            if not math.isnan(value):
                found.append((dict(series["metric"]), value))
        return found

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets, each with its labels and `health` (up, down, unknown)."""
        return list(self._get("/api/v1/targets", {"state": "active"})["activeTargets"])
