"""The control plane writes endpoint files by atomic rename, and a real Envoy picks them up."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from servemesh.catalog.file import CatalogEntry
from servemesh.contract.wire import GATEWAY_CLUSTER, feature_cluster, model_servers_cluster
from servemesh.discovery.control_plane import ControlPlane
from servemesh.identity import issue_mesh_certificates
from servemesh.procs import Check, Supervisor
from servemesh.proxy.admin import AdminClient, admin_socket_path, prepare_admin_dir
from servemesh.proxy.apply import write_initial
from servemesh.proxy.process import envoy_command, is_ready
from servemesh.proxy.render import dynamic_bootstrap, render_resources
from servemesh.spec import MeshSpec, ResolvedSpec, ServiceKind, resolve
from servemesh.state.paths import MeshPaths
from tests.waiting import wait_until


class ListedCatalog:
    """A catalog whose instances the test sets; a watcher blocks until they change."""

    def __init__(self, entries: list[CatalogEntry]) -> None:
        self._entries = entries
        self._index = 1
        self._changed = threading.Condition()
        self._closed = False

    def set(self, entries: list[CatalogEntry]) -> None:
        with self._changed:
            self._entries = entries
            self._index += 1
            self._changed.notify_all()

    def watch(self, kind: ServiceKind, index: int, wait_s: float) -> tuple[int, list[CatalogEntry]]:
        with self._changed:
            self._changed.wait_for(lambda: self._closed or self._index != index, wait_s)
            return self._index, [e for e in self._entries if e.kind == kind]

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


def _spec(state: Path) -> ResolvedSpec:
    """One Envoy for the whole mesh (the shared layout): every cluster's files in one folder."""
    declared = {"ports": {"edge": 0, "mesh": 0, "services_base": 0, "envoy_admin": 0},
                "state_dir": str(state), "tracing": {"enabled": False},
                "proxy": {"layout": "shared"}}  # fmt: skip
    return resolve(MeshSpec.model_validate(declared))


MODEL_A = CatalogEntry("model", "model-fraud-zone-a-0", "zone-a", "127.0.0.2", 41001)
MODEL_B = CatalogEntry("model", "model-fraud-zone-b-0", "zone-b", "127.0.0.3", 41002)
FEATURE_A = CatalogEntry("feature", "feature-zone-a-0", "zone-a", "127.0.0.4", 41003)


def test_only_changed_files_are_renamed_into_place_and_run_follows_the_catalog(
    tmp_path: Path,
) -> None:
    spec = _spec(tmp_path)
    layout = MeshPaths(tmp_path).xds
    catalog = ListedCatalog([MODEL_A, FEATURE_A])
    plane = ControlPlane(spec, catalog, MeshPaths(tmp_path))
    first = threading.Event()
    runner = threading.Thread(target=plane.run, args=(first.set,))
    runner.start()
    try:
        assert first.wait(30), "the first endpoint files were never written"
        models = layout.eds(model_servers_cluster("zone-a"))
        features = layout.eds(feature_cluster("zone-a"))
        inode_models, inode_features = models.stat().st_ino, features.stat().st_ino
        rounds = plane.rounds
        catalog.set([MODEL_A, MODEL_B, FEATURE_A])
        wait_until(lambda: models.stat().st_ino != inode_models, "the model servers' file renamed")
        wait_until(lambda: plane.rounds > rounds, "the round to finish")
        # A rename, never a write in place (Envoy notices only renames); the file whose
        # endpoints did not change was left alone.
        assert features.stat().st_ino == inode_features
        assignment = yaml.safe_load(models.read_text())["resources"][0]
        zones = {loc["locality"]["zone"]: loc["priority"] for loc in assignment["endpoints"]}
        assert zones == {"zone-a": 0, "zone-b": 1}
        assert not [p for p in models.parent.iterdir() if p.name.startswith(".")]
    finally:
        plane.stop()
        runner.join(30)
    assert not runner.is_alive()


@pytest.fixture
def envoy(tmp_path: Path) -> Iterator[tuple[ResolvedSpec, AdminClient]]:
    """A real Envoy on the spec's dynamic bootstrap, reading its endpoints from watched files."""
    spec = _spec(tmp_path)
    issue_mesh_certificates(spec)
    logs = tmp_path / "logs"
    logs.mkdir()
    resources = render_resources(spec, logs)
    paths = MeshPaths(tmp_path)
    write_initial(spec, resources, paths.xds)
    paths.envoy_config.parent.mkdir(parents=True, exist_ok=True)
    paths.envoy_config.write_text(
        yaml.safe_dump(dynamic_bootstrap(spec, resources, paths.xds, logs), sort_keys=False)
    )
    prepare_admin_dir(tmp_path)
    admin = admin_socket_path(tmp_path)
    with Supervisor(logs) as supervisor:
        argv = envoy_command(paths.envoy_config, base_id=spec.ports.envoy_admin)
        ready = Check(lambda: is_ready(admin), "Envoy ready")
        supervisor.start("envoy", argv, ready=ready, timeout_s=60)
        yield spec, AdminClient(admin)


def test_a_running_envoy_serves_the_endpoints_the_control_plane_writes(
    envoy: tuple[ResolvedSpec, AdminClient], tmp_path: Path
) -> None:
    spec, admin = envoy
    plane = ControlPlane(spec, ListedCatalog([]), MeshPaths(tmp_path))
    cluster = model_servers_cluster("zone-b")
    # Before: the spec's own instances on loopback (the file catalog's endpoints).
    assert {h.address for h in admin.clusters()[cluster].hosts} == {
        spec.address_of("model-fraud-zone-a-0"),
        spec.address_of("model-fraud-zone-b-0"),
    }
    written = plane.sync([MODEL_A, MODEL_B, FEATURE_A])
    assert MeshPaths(tmp_path).xds.eds(cluster) in written

    def hosts() -> set[tuple[str, str, int]]:
        return {(h.address, h.zone, h.priority) for h in admin.clusters()[cluster].hosts}

    wait_until(
        lambda: hosts() == {("127.0.0.2:41001", "zone-a", 1), ("127.0.0.3:41002", "zone-b", 0)},
        "Envoy to serve the catalog's model servers, its own zone first",
    )
    # Every instance gone from the catalog: an empty set, not the old endpoints.
    plane.sync([])
    wait_until(lambda: hosts() == set(), "Envoy to drop the endpoints")


def test_each_envoy_of_the_per_zone_layout_gets_the_endpoints_of_its_own_clusters(
    tmp_path: Path,
) -> None:
    declared = {"ports": {"edge": 0, "mesh": 0, "services_base": 0, "envoy_admin": 0},
                "state_dir": str(tmp_path), "tracing": {"enabled": False},
                "proxy": {"layout": "per_zone"}}  # fmt: skip
    spec = resolve(MeshSpec.model_validate(declared))
    paths = MeshPaths(tmp_path)
    plane = ControlPlane(spec, ListedCatalog([]), paths)
    gateway = CatalogEntry("gateway", "gateway-zone-b-0", "zone-b", "127.0.0.5", 41004)
    written = plane.sync([MODEL_A, MODEL_B, FEATURE_A, gateway])
    edge, zone_a, zone_b = (paths.xds_of(p) for p in ("envoy", "zone-a", "zone-b"))
    # The edge's Envoy holds the gateways; each zone's, its own clusters only.
    assert edge.eds(GATEWAY_CLUSTER) in written
    assert not edge.eds(model_servers_cluster("zone-a")).exists()
    assert zone_a.eds(model_servers_cluster("zone-a")) in written
    assert not zone_a.eds(model_servers_cluster("zone-b")).exists()
    assert not zone_a.eds(GATEWAY_CLUSTER).exists()
    assignment = yaml.safe_load(zone_b.eds(model_servers_cluster("zone-b")).read_text())
    zones = {
        loc["locality"]["zone"]: loc["priority"] for loc in assignment["resources"][0]["endpoints"]
    }
    assert zones == {"zone-b": 0, "zone-a": 1}
    gateways = yaml.safe_load(edge.eds(GATEWAY_CLUSTER).read_text())["resources"][0]
    hosts = [e["endpoint"]["address"]["socket_address"] for loc in gateways["endpoints"]
             for e in loc["lb_endpoints"]]  # fmt: skip
    assert hosts == [{"address": "127.0.0.5", "port_value": 41004}]
