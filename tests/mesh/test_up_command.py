"""`servemesh up` as a newcomer runs it: starts everything, answers, stops with nothing left.

With `--netns` (root), each zone's services run in a network namespace of their own, and a
weight change keeps every zone's Envoy clusters sending from that zone's own source.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.wire import zone_of_cluster
from servemesh.identity import dial_edge_at
from servemesh.procs import Check, Supervisor
from servemesh.procs.netns import available
from servemesh.spec import MeshSpec, ProxySpec
from servemesh.spec.policy import EdgeAuth
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import test_mesh_spec
from tests.waiting import wait_until

NETNS, NO_NETNS = available()


def _port_is_free(host: str, port: int) -> bool:
    """Nothing is bound or listening (connections in TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """A one-shot servemesh command (in `cwd`, with `env` added to the environment)."""
    return subprocess.run(
        [sys.executable, "-m", "servemesh", *args],
        capture_output=True, text=True, timeout=60, check=False, cwd=cwd,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def _dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    with subprocess.Popen(["true"]) as child:
        child.wait()
    return child.pid


class Predicting:
    """Predicts through an edge, one after another on a thread, until stopped: how many
    were answered, and every failure."""

    def __init__(self, spec: MeshSpec, edge: str) -> None:
        self.spec, self.edge = spec, edge
        self.answered = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="predicting", daemon=True)

    def _run(self) -> None:
        with dial_edge_at(self.spec, self.edge).channel() as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            while not self._stop.is_set():
                request = gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-3"])
                try:
                    stub.Predict(request, timeout=5)
                    self.answered += 1
                except grpc.RpcError as exc:
                    self.failures.append(f"{exc.code().name}: {exc.details()}")

    def __enter__(self) -> Predicting:
        self._thread.start()
        wait_until(lambda: self.answered or self.failures, "a first answer through the edge")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class Up:
    """`servemesh up` running as a child; stop() sends SIGTERM, as Ctrl-C would."""

    def __init__(self, supervisor: Supervisor, state: Path, log: Path) -> None:
        self.supervisor = supervisor
        self.state = state
        self.log = log

    @property
    def endpoints(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.state / "endpoints.json").read_text())
        return data

    @property
    def output(self) -> str:
        """What `up` printed (stdout and stderr)."""
        return self.log.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.supervisor.pid("up")

    def stop(self) -> int | None:
        """SIGTERM; the exit status once `up` stopped every process it started."""
        return self.supervisor.stop("up", grace_s=60)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Callable[..., Up]]:
    with Supervisor(tmp_path / "logs") as supervisor:

        def start(spec: MeshSpec, *flags: str) -> Up:
            spec_path = tmp_path / "mesh.yaml"
            spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
            endpoints = Path(spec.state_dir) / "endpoints.json"
            argv = [sys.executable, "-m", "servemesh", "up", "--spec", str(spec_path), *flags]
            # endpoints.json is written once every service is SERVING and Envoy is ready.
            ready = Check(endpoints.exists, f"{endpoints} written")
            child = supervisor.start("up", argv, ready=ready, timeout_s=180)
            assert child.launch.log_path is not None
            return Up(supervisor, Path(spec.state_dir), child.launch.log_path)

        yield start


def test_up_serves_predictions_and_stops_cleanly_on_sigterm(
    tmp_path: Path, up: Callable[..., Up]
) -> None:
    spec = test_mesh_spec(str(tmp_path / "state"), entities=100)
    # With edge auth on: the CLI finds the mesh's key; a caller without it is refused.
    traffic = spec.traffic.model_copy(update={"edge_auth": EdgeAuth(enabled=True)})
    mesh = up(spec.model_copy(update={"traffic": traffic}))
    endpoints = mesh.endpoints
    credentials = tmp_path / "state" / "edge-credentials"
    assert credentials.stat().st_mode & 0o777 == 0o600
    key = credentials.read_text().strip().split(":", 1)[1]
    assert key not in (tmp_path / "state" / "envoy" / "envoy.static.yaml").read_text()
    with dial_edge_at(spec, endpoints["edge"]).channel() as channel:
        with pytest.raises(grpc.RpcError) as refused:
            gateway_pb2_grpc.GatewayStub(channel).Predict(
                gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1"]), timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    predicted = _cli("predict", "--model", "fraud", "--entity", "user-42",
                     "--address", endpoints["edge"], "--json",
                     "--state-dir", str(tmp_path / "state"))  # fmt: skip
    assert predicted.returncode == 0, predicted.stderr
    answer = json.loads(predicted.stdout)
    assert len(answer["scores"]) == 1 and 0.0 <= answer["scores"][0] <= 1.0
    assert answer["model_version"] == "v1" and answer["request_id"]

    assert mesh.stop() == 0, mesh.output
    assert "stopped" in mesh.output
    pids = endpoints["pids"]
    assert {"redis", "envoy", "registry-0", "gateway-zone-a-0", "model-fraud-zone-b-0"} <= set(pids)
    assert not [name for name, pid in pids.items() if _pid_exists(pid)]
    ports = [
        int(a.rsplit(":", 1)[1])
        for a in [
            endpoints["edge"],
            endpoints["mesh"],
            endpoints["redis"].rsplit("/", 1)[0],
            *endpoints["services"].values(),
        ]
    ]
    assert [p for p in ports if not _port_is_free("127.0.0.1", p)] == []
    # Envoy's admin API was a Unix socket in the state dir, never a port.
    assert endpoints["envoy_admin"].endswith(".sock")


def test_a_second_up_on_a_held_state_dir_is_refused_and_the_first_mesh_keeps_answering(
    tmp_path: Path, up: Callable[..., Up]
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    # The lock a killed mesh left behind: the first `up` takes it over, saying so.
    dead = _dead_pid()
    lock = state / "mesh.lock"
    lock.write_text(json.dumps({"pid": dead, "edge": "127.0.0.1:1", "started_at": 1.0}))
    lock.chmod(0o600)
    spec = test_mesh_spec(str(state), entities=100)
    mesh = up(spec)
    assert (
        f"note: taking over {state} from a mesh that was not stopped "
        f"(pid {dead}, edge 127.0.0.1:1, no longer running)"
    ) in mesh.output
    edge = mesh.endpoints["edge"]
    kept = {name: (state / name).read_bytes() for name in ("endpoints.json", "mesh.resolved.yaml")}

    # A second `up` on the same spec (so the same state dir), as `make up` run twice:
    # refused with one line naming the running mesh, while callers keep getting answers.
    with Predicting(spec, edge) as calls:
        second = _cli("up", "--spec", str(tmp_path / "mesh.yaml"))
        seen = calls.answered
        wait_until(lambda: calls.answered > seen, "an answer after the refused start")
    assert second.returncode == 4, second.stderr + second.stdout
    assert second.stderr.splitlines() == [
        f"error: a mesh is already running from {state} (pid {mesh.pid}, edge {edge}): stop it "
        f"first (`servemesh down --state-dir {state}`), or give this one another --state-dir"
    ]
    assert calls.failures == [] and calls.answered > 0
    # Nothing of the first mesh's was touched: its files, its lock.
    assert {name: (state / name).read_bytes() for name in kept} == kept
    assert json.loads(lock.read_text())["pid"] == mesh.pid
    # ... and the commands still find it through its state dir.
    predicted = _cli("predict", "--model", "fraud", "--entity", "user-42", "--json",
                     "--state-dir", str(state))  # fmt: skip
    assert predicted.returncode == 0, predicted.stderr
    answer = json.loads(predicted.stdout)
    assert answer["model_version"] == "v1" and answer["tier"] == "online", answer

    assert mesh.stop() == 0, mesh.output
    assert lock.read_text() == ""  # stopped cleanly: the state dir is free


def test_status_and_down_from_another_folder(tmp_path: Path, up: Callable[..., Up]) -> None:
    state = tmp_path / "state"
    mesh = up(test_mesh_spec(str(state), entities=100))
    endpoints = mesh.endpoints
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = _cli("status", "--state-dir", str(state), "--json", cwd=elsewhere)
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["state"] == "running" and status["pid"] == mesh.pid
    assert status["edge"] == endpoints["edge"]
    rows = {row["endpoint"]: row for row in status["processes"]}
    assert rows["edge (clients, grpcurl)"]["address"] == endpoints["edge"]
    assert rows["edge (clients, grpcurl)"]["health"] == "ready"
    services = endpoints["services"]
    assert {name: rows[name]["pid"] for name in services} == {
        name: endpoints["pids"][name] for name in services
    }
    assert {rows[name]["health"] for name in services} == {"SERVING"}
    assert {rows[name]["state"] for name in services} == {"running"}
    # The environment names the state dir just as well; the table is the one `up` printed.
    table = _cli("status", cwd=elsewhere, env={"SERVEMESH_STATE_DIR": str(state)})
    assert table.returncode == 0, table.stderr
    assert f"mesh at {state}: `servemesh up` pid {mesh.pid}" in table.stdout
    assert endpoints["edge"] in table.stdout and "SERVING" in table.stdout

    # Stopped from there, as Ctrl-C in its `up` would: `up` ends as it does after Ctrl-C.
    down = _cli("down", cwd=elsewhere, env={"SERVEMESH_STATE_DIR": str(state)})
    assert down.returncode == 0, down.stderr
    assert f"stopped the mesh at {state} (pid {mesh.pid})" in down.stdout
    up_child = mesh.supervisor.child("up")
    assert up_child.wait(60) == 0, mesh.output
    assert "stopped" in mesh.output
    assert not [name for name, pid in endpoints["pids"].items() if _pid_exists(pid)]
    # Nothing runs there now: the line says how to point at a mesh that does.
    after = _cli("status", "--state-dir", str(state), cwd=elsewhere)
    assert after.returncode == 5
    assert after.stderr.splitlines() == [
        f"error: no running mesh at {state}: start one with `servemesh up`, or point at a "
        "running one with --state-dir DIR or SERVEMESH_STATE_DIR"
    ]


def _bind_configs(state: Path) -> tuple[int, int]:
    """In the CDS file Envoy watches: how many clusters send from a source of their own,
    and how many clusters serve one zone's callers."""
    cds = yaml.safe_load((state / "xds" / "cds" / "clusters.yaml").read_text())
    clusters = cds["resources"]
    bound = sum("upstream_bind_config" in c for c in clusters)
    return bound, sum(zone_of_cluster(c["name"]) is not None for c in clusters)


def _namespace_of(pid: int) -> str:
    done = subprocess.run(
        ["ip", "netns", "identify", str(pid)], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


@pytest.mark.skipif(not NETNS, reason=f"zone namespaces unavailable here: {NO_NETNS}")
def test_up_netns_keeps_each_zones_source_through_a_weight_change(
    tmp_path: Path, up: Callable[..., Up]
) -> None:
    state = tmp_path / "state"
    # One Envoy for every zone (the shared layout), on the machine: each zone's clusters
    # send from that zone's source (an Envoy per zone runs inside its zone instead:
    # tests/netns/test_zone_envoys.py).
    spec = test_mesh_spec(str(state), entities=100)
    spec = spec.model_copy(update={"proxy": ProxySpec(layout="shared")})
    mesh = up(spec, "--netns")
    endpoints = mesh.endpoints
    pids = endpoints["pids"]
    # Each zone's services run in that zone's namespace; Envoy stays on the machine.
    zone_a, zone_b = (
        _namespace_of(pids["model-fraud-zone-a-0"]),
        _namespace_of(pids["model-fraud-zone-b-0"]),
    )
    assert zone_a and zone_b and zone_a != zone_b
    assert _namespace_of(pids["gateway-zone-a-0"]) == zone_a
    assert _namespace_of(pids["envoy"]) == ""
    resolved = yaml.safe_load((state / "mesh.resolved.yaml").read_text())
    assert resolved["network"] == {"mode": "netns"}

    before, zone_clusters = _bind_configs(state)
    assert before == zone_clusters > 0
    changed = _cli("routes", "--state-dir", str(state), "set", "fraud", "v1=50", "v2=50")
    assert changed.returncode == 0, changed.stderr + changed.stdout
    assert "applied as change #1" in changed.stdout
    assert _bind_configs(state) == (before, zone_clusters)
    # A policy change rewrites every model cluster: each keeps its zone's source.
    live = yaml.safe_load((state / "mesh.resolved.yaml").read_text())
    live["traffic"]["model"]["circuit_breakers"]["max_requests"] = 777
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(live))
    applied = _cli("routes", "--state-dir", str(state), "apply", str(policy))
    assert applied.returncode == 0, applied.stderr + applied.stdout
    assert "max_requests: 777" in (state / "xds" / "cds" / "clusters.yaml").read_text()
    assert _bind_configs(state) == (before, zone_clusters)
    rolled = _cli("routes", "--state-dir", str(state), "rollback")
    assert rolled.returncode == 0, rolled.stderr + rolled.stdout
    assert _bind_configs(state) == (before, zone_clusters)
    # ... and callers still get answers through the zones' namespaces.
    edge = endpoints["edge"]
    predicted = _cli("predict", "--model", "fraud", "--entity", "user-7",
                     "--address", edge, "--json", "--state-dir", str(state))  # fmt: skip
    assert predicted.returncode == 0, predicted.stderr

    assert mesh.stop() == 0, mesh.output
    assert not [name for name, pid in pids.items() if _pid_exists(pid)]
    # Names carry the owner's PID and a tag: sm<pid>-<tag>-<zone>, chains SM<pid>-<tag>-*.
    prefix = zone_a.removesuffix("-zone-a")
    assert prefix.startswith("sm") and zone_b == f"{prefix}-zone-b"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{prefix}-" not in listed and f"{prefix}_" not in listed
    nat = subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True).stdout
    assert f"SM{prefix[2:]}-" not in nat
