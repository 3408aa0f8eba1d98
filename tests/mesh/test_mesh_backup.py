"""`servemesh backup` / `servemesh restore` on a running mesh: one folder holds every store
(registry, feature store, prediction log, routes); losses in each are put back; a backup
that does not verify changes nothing.

A mesh of its own, not the package's: the test moves weights several times, and a model
server follows each move a little later (its live spec), so a module right after it on a
shared mesh would see a late move undo what it did (a version it unloaded loaded again)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from servemesh.cli import main
from servemesh.launcher import Mesh
from servemesh.predlog.buffer import predictions_dir
from servemesh.predlog.parquet_store import live_files
from servemesh.predlog.references import reference_path
from servemesh.proxy.apply import RouteManager
from servemesh.spec.store_clients import store_writer_sync
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from tests.mesh.conftest import test_mesh_spec
from tests.waiting import wait_until

ENTITIES = [f"user-{n}" for n in range(1, 21)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    state_dir = tmp_path_factory.mktemp("backup-mesh")
    with Mesh.from_spec(test_mesh_spec(str(state_dir))) as running:
        yield running


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _scores(gateway: gateway_pb2_grpc.GatewayStub) -> list[float]:
    # Pinned to v1: what the weights say must not change the score compared.
    reply = gateway.Predict(
        gateway_pb2.PredictRequest(model="fraud", version="v1", entity_ids=ENTITIES), timeout=10
    )
    assert not reply.degraded, reply.degraded_reason
    return [round(s, 6) for s in reply.scores]


def _keys(client: redis.Redis, prefix: str) -> set[bytes]:
    return set(client.scan_iter(match=f"{prefix}:*", count=1000))


def _weights(mesh: Mesh) -> dict[str, int]:
    return dict(RouteManager(mesh.paths).live_spec().models["fraud"].traffic)


def test_a_backup_of_every_store_puts_back_what_each_lost_and_a_damaged_one_nothing(
    mesh: Mesh,
    gateway: gateway_pb2_grpc.GatewayStub,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = str(mesh.state_dir)
    routes = RouteManager(mesh.paths)
    client = store_writer_sync(mesh.spec)
    prefix = mesh.spec.feature_store.key_prefix
    try:
        before_scores = _scores(gateway)
        log_root = predictions_dir(mesh.state_dir)
        wait_until(lambda: live_files(log_root), "a prediction log file on disk", timeout_s=30)
        routes.set_weights("fraud", {"v1": 90, "v2": 10})
        keys_before = _keys(client, prefix)
        train = tmp_path / "train.parquet"
        pq.write_table(pa.table({"f00": [0.1 * n for n in range(100)]}), train)
        code, text = _cli(capsys, "drift", "fraud", "--set-reference", str(train),
                          "--state-dir", state)  # fmt: skip
        assert code == 0, text
        reference = reference_path(mesh.state_dir, "fraud")
        reference_bytes = reference.read_bytes()

        code, text = _cli(capsys, "backup", "--out", str(tmp_path / "bk"), "--state-dir", state,
                          "--json")  # fmt: skip
        assert code == 0, text
        taken = json.loads(text)
        assert set(taken["parts"]) == {"registry", "features", "predictions", "routes"}, taken
        assert taken["parts"]["features"]["summary"]["keys"] == len(keys_before)
        assert taken["parts"]["registry"]["summary"]["versions"] == 3
        files_backed = taken["parts"]["predictions"]["summary"]["files"]
        assert files_backed >= 1
        assert (tmp_path / "bk").stat().st_mode & 0o077 == 0

        # Losses: the feature store emptied, a gateway's log files gone, the weights moved.
        client.delete(*keys_before)
        lost_files = [f.path for f in live_files(log_root)]
        for path in lost_files:
            path.unlink()
        routes.set_weights("fraud", {"v1": 100})
        reference.unlink()
        with pytest.raises(grpc.RpcError):
            _scores(gateway)  # no features: no real answer

        # A damaged backup: one byte of the feature store's file changed. Nothing moves.
        damaged = tmp_path / "damaged"
        shutil.copytree(tmp_path / "bk", damaged)
        data = damaged / "features" / "feature-store.jsonl"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
        code, text = _cli(capsys, "restore", str(damaged), "--state-dir", state)
        assert code == 1, text
        assert "sha256" in text, text
        assert _keys(client, prefix) == set()
        assert _weights(mesh)["v1"] == 100
        assert not (log_root / f"{lost_files[0].parent.name}.restored").exists()
        assert not reference.exists()

        # The good one: every part back; the registry held its versions already.
        code, text = _cli(capsys, "restore", str(tmp_path / "bk"), "--state-dir", state,
                          "--json")  # fmt: skip
        assert code == 0, text
        done: dict[str, Any] = json.loads(text)
        parts = done["parts"]
        assert parts["registry"]["detail"]["already_there"] == 3, parts["registry"]
        assert parts["registry"]["detail"]["versions"] == 0
        assert parts["features"]["detail"]["keys"] == len(keys_before)
        assert parts["predictions"]["detail"]["files"] >= len(lost_files)
        assert parts["routes"]["detail"]["changed"] == ["fraud: v1=90 v2=10 v3=0"], parts
        assert "drift/fraud.json" in parts["routes"]["detail"]["records_put_back"], parts
        assert reference.read_bytes() == reference_bytes
        assert done["backup_age_s"] >= 0 and done["seconds"] > 0
        assert _keys(client, prefix) == keys_before
        assert _scores(gateway) == before_scores
        assert {k: v for k, v in _weights(mesh).items() if v} == {"v1": 90, "v2": 10}
        restored = [f for f in live_files(log_root) if f.path.parent.name.endswith(".restored")]
        assert len(restored) == parts["predictions"]["detail"]["files"]

        # Again: nothing is missing now, so nothing is put back twice.
        code, text = _cli(capsys, "restore", str(tmp_path / "bk"), "--state-dir", state,
                          "--json")  # fmt: skip
        assert code == 0, text
        again = json.loads(text)["parts"]
        assert again["predictions"]["detail"]["files"] == 0, again
        assert again["routes"]["detail"]["changed"] == [], again
        assert again["routes"]["detail"]["records_put_back"] == [], again
    finally:
        reference_path(mesh.state_dir, "fraud").unlink(missing_ok=True)
        if _weights(mesh).get("v1") != 100:
            routes.set_weights("fraud", {"v1": 100})
        client.close()


def test_restore_refuses_a_folder_that_is_no_backup_and_backup_a_folder_in_use(
    mesh: Mesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = str(mesh.state_dir)
    (tmp_path / "busy" / "x").mkdir(parents=True)
    code, text = _cli(capsys, "backup", "--out", str(tmp_path / "busy"), "--state-dir", state)
    assert code == 1 and "not empty" in text, text
    (tmp_path / "empty").mkdir()
    code, text = _cli(capsys, "restore", str(tmp_path / "empty"), "--state-dir", state)
    assert code == 1 and "manifest.json" in text, text
