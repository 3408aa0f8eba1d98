"""A replicated feature store (feature_store.topology: replicated) loses a whole zone with
its primary: the other zone's Sentinel and the witness promote that zone's replica, a
feature load and the demo's seeding reach the new primary. The primary lost under load
during a feature load is a drill (chaos/experiments/feature-primary-loss.yaml, run by
tests/chaos/test_drills.py)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from servemesh.contract.demo import DEMO_FEATURES
from servemesh.launcher import Mesh
from servemesh.seeding import seed_demo_features
from servemesh.spec import SENTINEL_MASTER_NAME, MeshSpec
from tests.waiting import wait_until

ONE_EACH = {"per_zone": {"zone-a": 1, "zone-b": 1}}
ENTITIES = 20


def replicated_spec() -> MeshSpec:
    return MeshSpec.model_validate(
        {
            "zones": ["zone-a", "zone-b"],
            "ports": {"edge": 0, "mesh": 0, "envoy_admin": 0, "services_base": 0},
            "gateway": ONE_EACH,
            "feature": ONE_EACH,
            "model_servers": ONE_EACH,
            "demo": {"entities": ENTITIES},
            "feature_store": {"topology": "replicated"},
        }
    )


@pytest.fixture
def settled_mesh(tmp_path: Path) -> Iterator[Mesh]:
    """A mesh of its own: Sentinel starts no failover within twice its failover timeout of
    the last one it took part in, so a zone lost right after another test's failover
    would test that wait, not the witness."""
    with Mesh.from_spec(replicated_spec(), tmp_path / "state") as running:
        yield running


def primary_of(mesh: Mesh) -> tuple[str, int] | None:
    """The primary the first Sentinel that answers names now."""
    password = mesh.spec.redis_password()
    for host, port in mesh.spec.sentinels:
        try:
            with redis.Redis(
                host=host, port=port, password=password, decode_responses=True
            ) as sentinel:
                found = sentinel.sentinel_get_master_addr_by_name(SENTINEL_MASTER_NAME)
        except redis.ConnectionError:
            continue  # a Sentinel a test killed
        return (str(found[0]), int(found[1])) if found else None
    return None


def write_rows(path: Path, entities: list[str]) -> None:
    rows = np.random.default_rng(7).normal(size=(len(entities), len(DEMO_FEATURES)))
    lines = [",".join(["id", *DEMO_FEATURES])]
    lines += [",".join([e, *map(str, row)]) for e, row in zip(entities, rows, strict=True)]
    path.write_text("\n".join(lines) + "\n")


def load(mesh: Mesh, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "servemesh", "features", "load", str(path), "--view", "user",
         "--key", "id", "--state-dir", str(mesh.state_dir)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_lost_zone_takes_a_sentinel_with_it_and_the_witness_still_makes_a_majority(
    settled_mesh: Mesh, tmp_path: Path
) -> None:
    """Two zones: the primary's zone lost whole (its store processes and its Sentinel), the
    other zone's Sentinel and the witness are two of three, and promote the other zone's
    replica. Without the witness that Sentinel would be one of two, and nothing would."""
    mesh = settled_mesh
    assert len(mesh.sentinels) == 3 and "witness" in mesh.sentinels
    assert mesh.sentinels["witness"].quorum == 2
    primary = primary_of(mesh)
    assert primary is not None
    replicas = {zone: mesh.spec.store_replica(zone) for zone in mesh.spec.zones}
    # The launcher's own Redis, the primary at the start, is in no zone: lost with zone-a.
    assert primary == (mesh.spec.host, mesh.spec.embedded_redis_port)
    lost, kept = "zone-a", "zone-b"
    for name in ("redis", f"redis-replica-{lost}", f"redis-sentinel-{lost}"):
        mesh.supervisor.kill(name, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(
        lambda: primary_of(mesh) == replicas[kept],
        f"{kept}'s Sentinel and the witness to promote {kept}'s replica",
    )
    promoted_s = time.monotonic() - killed_at
    # And the store takes writes again: a feature load, through the Sentinels that are left.
    rows = tmp_path / "users.csv"
    write_rows(rows, [f"user-{i}" for i in range(ENTITIES)])
    wait_until(lambda: load(mesh, rows).returncode == 0, "a feature load on the new primary")
    # The new primary has no replica left (zone-a's went with its zone): a load is current
    # on it, and the command says no replica held it when it was acknowledged.
    alone = load(mesh, rows)
    assert alone.returncode == 0, alone.stderr
    assert "warning: no replica of the store held the load" in alone.stdout, alone.stdout
    # The demo's seeding too (what `up` and `compose seed` run): it follows the Sentinels,
    # not the lost primary the spec's URL names.
    asyncio.run(seed_demo_features(mesh.spec, ["user"]))
    print(f"zone {lost} lost: {kept}'s replica promoted {promoted_s:.2f} s after the SIGKILLs")
