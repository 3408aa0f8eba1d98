"""The mesh's alert routing without a mesh: Alertmanager's config (checked by amtool where
installed) routes each severity to the mesh's receiver and the spec's webhooks, and the
receiver keeps what Alertmanager sends and refuses what it does not."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.contract.yaml_text import dump_yaml
from servemesh.observe.alert_receiver import MAX_BODY_BYTES, _Receiver, read_received, received_path
from servemesh.procs.alertmanager import render_config
from servemesh.spec import MeshSpec, Ports, resolve
from servemesh.spec.observability import MetricsSpec

PAGER = "https://pager.example.test/hook"


def test_each_severity_goes_to_the_mesh_receiver_and_the_spec_s_webhooks(tmp_path: Path) -> None:
    metrics = MetricsSpec(scrape_interval_s=1.0, alert_webhooks={"page": [PAGER]})
    spec = resolve(MeshSpec(ports=Ports.free(), state_dir=str(tmp_path), metrics=metrics))
    config = render_config(spec, "http://127.0.0.1:9")
    routes = {r["matchers"][0]: r["receiver"] for r in config["route"]["routes"]}
    assert routes == {'severity="page"': "page", 'severity="ticket"': "ticket"}
    hooks = {
        r["name"]: [(w["url"], w["send_resolved"]) for w in r["webhook_configs"]]
        for r in config["receivers"]
    }
    assert hooks == {
        "mesh": [("http://127.0.0.1:9/mesh", True)],
        "page": [("http://127.0.0.1:9/page", True), (PAGER, True)],
        "ticket": [("http://127.0.0.1:9/ticket", True)],
    }
    assert (config["route"]["group_wait"], config["route"]["group_interval"]) == ("2s", "5s")
    amtool = shutil.which("amtool")
    if amtool is not None:  # Debian's prometheus-alertmanager ships it
        path = tmp_path / "alertmanager.yml"
        path.write_text(dump_yaml(config))
        checked = subprocess.run(
            [amtool, "check-config", str(path)], capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_webhook_that_is_not_http_is_refused() -> None:
    with pytest.raises(ValueError, match="alert_webhooks"):
        MetricsSpec(alert_webhooks={"page": ["file:///etc/passwd"]})


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[str]:
    path = received_path(tmp_path)
    path.parent.mkdir(parents=True)
    server = _Receiver(("127.0.0.1", 0), path)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def post(url: str, body: bytes) -> int:
    request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def declared_length(url: str, length: int) -> int:
    """A POST whose Content-Length says `length`, no body sent: refused from the header."""
    host, _, port = url.removeprefix("http://").rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        connection.putrequest("POST", "/page")
        connection.putheader("content-length", str(length))
        connection.endheaders()
        return connection.getresponse().status
    finally:
        connection.close()


def test_the_receiver_keeps_each_alert_and_refuses_what_is_not_a_webhook_body(
    receiver: str, tmp_path: Path
) -> None:
    alert = {
        "status": "firing",
        "labels": {"alertname": "ServemeshSLOFastBurn", "severity": "page", "model": "fraud"},
        "annotations": {"runbook": "docs/runbooks/slo-burn.md"},
        "startsAt": "2026-12-06T08:00:00Z",
        "endsAt": "0001-01-01T00:00:00Z",
        "fingerprint": "abc",
        "generatorURL": "http://prometheus/graph",
    }
    body = {"version": "4", "status": "firing", "receiver": "page", "alerts": [alert]}
    assert post(f"{receiver}/page", json.dumps(body).encode()) == 200
    assert post(f"{receiver}/page", b"{not json") == 400
    assert post(f"{receiver}/page", json.dumps({"alerts": "x"}).encode()) == 400
    assert declared_length(receiver, MAX_BODY_BYTES + 1) == 413
    assert declared_length(receiver, -5) == 400
    [kept] = read_received(tmp_path)
    assert kept["route"] == "page" and kept["labels"] == alert["labels"]
    assert kept["annotations"]["runbook"] == "docs/runbooks/slo-burn.md"
    assert "generatorURL" not in kept
