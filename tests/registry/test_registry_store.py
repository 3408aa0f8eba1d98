"""RegistryStore without a network: uploads, immutability, aliases, validation, cleanup."""

from __future__ import annotations

import hashlib
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import servemesh.registry.store as store_module
from servemesh.registry.errors import (
    AlreadyExistsError,
    ArtifactTooLargeError,
    BlobMissingError,
    DigestMismatchError,
    InvalidArgumentError,
    NotFoundError,
)
from servemesh.registry.records import TensorSpec, VersionRecord
from servemesh.registry.store import RegistryStore
from tests.registry.registry_kit import blob_files, blob_path, corrupt, header_for, temp_files

DATA = b"torchscript-ish bytes " * 1000


def upload(
    store: RegistryStore, data: bytes, chunk: int = 4096, **header_changes: Any
) -> VersionRecord:
    with store.begin_upload(header_for(data, **header_changes)) as up:
        for start in range(0, len(data), chunk):
            up.write(data[start : start + chunk])
        return up.commit()


def assert_nothing_left(store: RegistryStore, root: Path, model: str = "fraud") -> None:
    assert temp_files(root) == []
    assert blob_files(root) == []
    assert store.list_models() == []
    with pytest.raises(NotFoundError):
        store.list_versions(model)


def test_commit_stores_the_blob_at_its_content_address_and_records_the_version(
    store: RegistryStore, store_root: Path
) -> None:
    record = upload(store, DATA)

    sha = hashlib.sha256(DATA).hexdigest()
    assert (record.model, record.version, record.sha256, record.size_bytes) == (
        "fraud",
        "v1",
        sha,
        len(DATA),
    )
    assert blob_path(store_root, sha).read_bytes() == DATA
    assert temp_files(store_root) == []
    assert store.get_version("fraud", "v1") == record
    assert [m.name for m in store.list_models()] == ["fraud"]  # created by the upload
    with store.open_artifact(record) as blob:
        assert blob.read() == DATA


def test_sha256_mismatch_is_refused_and_leaves_no_row_blob_or_temp_file(
    store: RegistryStore, store_root: Path
) -> None:
    with pytest.raises(DigestMismatchError, match="header.sha256"):
        upload(store, DATA, sha256=hashlib.sha256(b"other").hexdigest())
    assert_nothing_left(store, store_root)


def test_fewer_bytes_than_declared_are_refused_and_leave_nothing(
    store: RegistryStore, store_root: Path
) -> None:
    with pytest.raises(DigestMismatchError, match="header.size_bytes"):
        upload(store, DATA, size_bytes=len(DATA) + 1)
    assert_nothing_left(store, store_root)


def test_bytes_beyond_the_declared_size_are_refused_at_the_overflowing_chunk(
    store: RegistryStore, store_root: Path
) -> None:
    up = store.begin_upload(header_for(DATA, size_bytes=10))
    up.write(b"0123456789")
    assert len(temp_files(store_root)) == 1
    with pytest.raises(DigestMismatchError, match="exceeds header.size_bytes"):
        up.write(b"x")
    assert_nothing_left(store, store_root)


def test_declared_size_over_the_limit_is_refused_before_any_byte(
    store: RegistryStore, store_root: Path
) -> None:
    with pytest.raises(ArtifactTooLargeError, match="header.size_bytes"):
        store.begin_upload(header_for(DATA, size_bytes=store.max_artifact_bytes + 1))
    assert_nothing_left(store, store_root)


def test_bytes_crossing_the_limit_are_refused_at_that_chunk(tmp_path: Path) -> None:
    root = tmp_path / "small"
    store = RegistryStore(root, max_artifact_bytes=1024)
    try:
        up = store.begin_upload(header_for(b"x" * 1024, size_bytes=1024))
        up.write(b"x" * 1000)
        with pytest.raises(ArtifactTooLargeError, match="1024 bytes"):
            up.write(b"x" * 100)
        assert_nothing_left(store, root)
    finally:
        store.close()


def test_identical_reupload_returns_the_existing_version_and_repairs_its_blob(
    store: RegistryStore, store_root: Path
) -> None:
    first = upload(store, DATA)
    corrupt(blob_path(store_root, first.sha256))

    with store.begin_upload(header_for(DATA)) as up:
        up.write(DATA)
        again = up.commit()

    assert again == first
    assert up.created is False
    assert blob_path(store_root, first.sha256).read_bytes() == DATA
    assert temp_files(store_root) == []


def test_reupload_with_other_bytes_is_refused_and_keeps_the_original(
    store: RegistryStore, store_root: Path
) -> None:
    first = upload(store, DATA)
    other = DATA + b"!"
    # Refused at the header, before any byte is sent...
    with pytest.raises(AlreadyExistsError, match="fraud/v1"):
        store.begin_upload(header_for(other))
    assert store.get_version("fraud", "v1") == first
    assert blob_files(store_root) == [blob_path(store_root, first.sha256)]


def test_a_racing_upload_of_the_same_version_with_other_bytes_loses_at_commit(
    store: RegistryStore, store_root: Path
) -> None:
    other = DATA + b"!"
    late = store.begin_upload(header_for(other))  # passes the header check: v1 is free
    late.write(other)
    first = upload(store, DATA)

    with pytest.raises(AlreadyExistsError):
        late.commit()
    assert store.list_versions("fraud") == [first]
    assert blob_files(store_root) == [blob_path(store_root, first.sha256)]
    assert temp_files(store_root) == []


def test_leaving_the_upload_block_without_commit_deletes_the_temp_file(
    store: RegistryStore, store_root: Path
) -> None:
    with store.begin_upload(header_for(DATA)) as up:
        up.write(DATA[:100])
        assert len(temp_files(store_root)) == 1
    assert_nothing_left(store, store_root)
    up.abort()  # idempotent


def test_a_failing_row_insert_removes_the_freshly_installed_blob(
    store: RegistryStore, store_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(specs: tuple[TensorSpec, ...]) -> str:
        raise OSError("disk full")

    # Serialising the signature happens after the blob is renamed into place.
    monkeypatch.setattr(store_module, "_specs_json", broken)
    with pytest.raises(OSError, match="disk full"):
        upload(store, DATA)
    assert_nothing_left(store, store_root)


def test_aliases_resolve_to_versions_and_can_be_moved(store: RegistryStore) -> None:
    v1 = upload(store, DATA, version="v1")
    v2 = upload(store, DATA + b"2", version="v2")

    assert store.set_alias("fraud", "production", "v1").aliases == {"production": "v1"}
    assert store.get_version("fraud", "production") == v1
    # An alias may name another alias: it takes that alias's current target.
    model = store.set_alias("fraud", "staging", "production")
    assert model.aliases == {"production": "v1", "staging": "v1"}
    store.set_alias("fraud", "production", "v2")
    assert store.get_version("fraud", "production") == v2
    assert store.get_model("fraud").aliases == {"production": "v2", "staging": "v1"}


def test_aliases_and_versions_cannot_shadow_each_other(store: RegistryStore) -> None:
    upload(store, DATA, version="v1")
    with pytest.raises(InvalidArgumentError, match="^alias: 'v1' is a version"):
        store.set_alias("fraud", "v1", "v1")
    store.set_alias("fraud", "production", "v1")
    with pytest.raises(AlreadyExistsError, match="^header.version: 'production' is an alias"):
        store.begin_upload(header_for(DATA + b"p", version="production"))


def test_unknown_model_version_and_alias_are_not_found_by_name(store: RegistryStore) -> None:
    with pytest.raises(NotFoundError, match="model 'nope' not found"):
        store.get_version("nope", "v1")
    upload(store, DATA)
    with pytest.raises(NotFoundError, match="'v9' of model 'fraud'"):
        store.get_version("fraud", "v9")
    with pytest.raises(NotFoundError, match="'v9' of model 'fraud'"):
        store.set_alias("fraud", "production", "v9")
    with pytest.raises(NotFoundError, match="model 'nope'"):
        store.list_versions("nope")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"model": "Fraud"}, "header.model"),
        ({"model": ""}, "header.model"),
        ({"version": "v1/../../etc"}, "header.version"),
        ({"version": "v1\n"}, "header.version"),
        ({"sha256": "ABC"}, "header.sha256"),
        ({"sha256": "A" * 64}, "header.sha256"),
        ({"size_bytes": 0}, "header.size_bytes"),
        ({"format": "pickle"}, "header.format"),
        ({"inputs": ()}, "header.inputs"),
        ({"inputs": (TensorSpec("x", "FLOAT", (1,)),)}, "header.inputs[0].datatype"),
        ({"inputs": (TensorSpec("x", "FP32", (0,)),)}, "header.inputs[0].shape"),
        ({"outputs": (TensorSpec("", "FP32", (1,)),)}, "header.outputs[0].name"),
        (
            {"outputs": (TensorSpec("y", "FP32", (1,)), TensorSpec("y", "FP32", (1,)))},
            "header.outputs[1].name",
        ),
        ({"labels": {"Bad Key": "x"}}, "header.labels"),
    ],
)
def test_malformed_header_fields_are_refused_naming_the_field(
    store: RegistryStore, store_root: Path, changes: dict[str, Any], field: str
) -> None:
    header = replace(header_for(DATA), **changes)
    with pytest.raises(InvalidArgumentError) as refused:
        store.begin_upload(header)
    assert str(refused.value).startswith(f"{field}: ")
    assert_nothing_left(store, store_root)


def test_bad_names_in_lookups_are_refused_naming_the_field(store: RegistryStore) -> None:
    with pytest.raises(InvalidArgumentError, match="^model: "):
        store.get_version("UPPER", "v1")
    with pytest.raises(InvalidArgumentError, match="^version: required"):
        store.get_version("fraud", "")
    with pytest.raises(InvalidArgumentError, match="^alias: "):
        store.set_alias("fraud", "-x", "v1")
    with pytest.raises(InvalidArgumentError, match="^name: "):
        store.create_model("a" * 64)


def test_create_model_refuses_a_taken_name(store: RegistryStore) -> None:
    created = store.create_model("fraud", "scores card payments")
    assert (created.name, created.description, created.aliases) == (
        "fraud",
        "scores card payments",
        {},
    )
    with pytest.raises(AlreadyExistsError, match="'fraud'"):
        store.create_model("fraud")


def test_metadata_and_blobs_survive_reopening_the_store(store_root: Path) -> None:
    first = RegistryStore(store_root, 1 << 20)
    record = upload(first, DATA)
    first.set_alias("fraud", "production", "v1")
    first.close()

    second = RegistryStore(store_root, 1 << 20)
    try:
        assert second.get_version("fraud", "production") == record
        with second.open_artifact(record) as blob:
            assert blob.read() == DATA
    finally:
        second.close()


def test_temp_files_of_a_crashed_process_are_swept_when_the_store_opens(
    store_root: Path,
) -> None:
    crashed = RegistryStore(store_root, 1 << 20)
    up = crashed.begin_upload(header_for(DATA))
    up.write(DATA[:10])  # never committed nor aborted: the process "dies" here
    crashed.close()
    assert len(temp_files(store_root)) == 1

    RegistryStore(store_root, 1 << 20).close()
    assert temp_files(store_root) == []
    up.abort()  # only releases the file handle the simulated crash left open


def test_a_version_whose_blob_vanished_reports_it_missing(
    store: RegistryStore, store_root: Path
) -> None:
    record = upload(store, DATA)
    blob_path(store_root, record.sha256).unlink()
    with pytest.raises(BlobMissingError, match="fraud/v1"):
        store.open_artifact(record)


def test_torch_export_archives_and_multi_tensor_signatures_are_recorded(
    store: RegistryStore,
) -> None:
    inputs = (TensorSpec("features", "FP32", (-1, 4)), TensorSpec("category", "INT64", (-1,)))
    outputs = (TensorSpec("probabilities", "BF16", (-1, 3)), TensorSpec("label", "BOOL", (-1,)))
    record = upload(store, DATA, format="torch_export", inputs=inputs, outputs=outputs)
    assert store.get_version("fraud", "v1") == record
    assert (record.format, record.inputs, record.outputs) == ("torch_export", inputs, outputs)


def test_lineage_and_metrics_are_stored_with_the_version(store: RegistryStore) -> None:
    lineage = {"data": "sha256:" + "ab" * 32, "code": "9ce8f64", "notebook": "runs/42"}
    record = upload(store, DATA, lineage=lineage, metrics={"auc": 0.91, "log_loss": 0.3})
    assert store.get_version("fraud", "v1") == record
    assert record.lineage == lineage and record.metrics == {"auc": 0.91, "log_loss": 0.3}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lineage": {"data": "md5:abc"}}, "header.lineage[data]: 'md5:abc' is not sha256:<64"),
        ({"lineage": {"code": "main"}}, "header.lineage[code]: 'main' is not a git commit"),
        ({"lineage": {"run": "two words"}}, "header.lineage[run]: 'two words' is not a reference"),
        ({"metrics": {"auc": float("nan")}}, "header.metrics[auc]: nan is not a finite number"),
        ({"metrics": {"AUC": 0.5}}, "header.metrics: key 'AUC' is not a valid metric name"),
    ],
)
def test_malformed_lineage_and_metrics_are_refused_naming_the_field(
    store: RegistryStore, store_root: Path, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        store.begin_upload(replace(header_for(DATA), **changes))
    assert refused.value.message.startswith(message)
    assert_nothing_left(store, store_root)


# The schema a store had before lineage and metrics (PRAGMA user_version 0).
SCHEMA_0 = """
CREATE TABLE models (name TEXT PRIMARY KEY, description TEXT NOT NULL,
                     created_unix_ms INTEGER NOT NULL);
CREATE TABLE versions (
    model TEXT NOT NULL REFERENCES models(name), version TEXT NOT NULL,
    sha256 TEXT NOT NULL, size_bytes INTEGER NOT NULL CHECK (size_bytes > 0),
    format TEXT NOT NULL, inputs TEXT NOT NULL, outputs TEXT NOT NULL, labels TEXT NOT NULL,
    created_unix_ms INTEGER NOT NULL, PRIMARY KEY (model, version));
CREATE TABLE aliases (model TEXT NOT NULL REFERENCES models(name), alias TEXT NOT NULL,
                      version TEXT NOT NULL, PRIMARY KEY (model, alias),
                      FOREIGN KEY (model, version) REFERENCES versions(model, version));
"""


def test_a_store_written_before_lineage_is_migrated_and_stays_readable(tmp_path: Path) -> None:
    root = tmp_path / "old"
    root.mkdir()
    sha = hashlib.sha256(DATA).hexdigest()
    (root / "blobs" / "sha256" / sha[:2]).mkdir(parents=True)
    (root / "blobs" / "sha256" / sha[:2] / sha).write_bytes(DATA)
    db = sqlite3.connect(root / "registry.db")
    db.executescript(SCHEMA_0)
    specs = '[{"name": "features", "datatype": "FP32", "shape": [-1, 64]}]'
    with db:
        db.execute("INSERT INTO models VALUES ('fraud', '', 1)")
        db.execute(
            "INSERT INTO versions VALUES ('fraud', 'v1', ?, ?, 'torchscript', ?, ?, '{}', 2)",
            (sha, len(DATA), specs, specs.replace("features", "score")),
        )
        db.execute("INSERT INTO aliases VALUES ('fraud', 'production', 'v1')")
    db.close()

    store = RegistryStore(root, 1 << 20)
    try:
        old = store.get_version("fraud", "production")
        assert (old.version, old.sha256, old.lineage, old.metrics) == ("v1", sha, {}, {})
        with store.open_artifact(old) as blob:
            assert blob.read() == DATA
        new = upload(store, b"v2 bytes", version="v2", metrics={"auc": 0.5})
        assert store.get_version("fraud", "v2").metrics == new.metrics == {"auc": 0.5}
    finally:
        store.close()
    db = sqlite3.connect(root / "registry.db")
    assert db.execute("PRAGMA user_version").fetchone()[0] == store_module.SCHEMA_VERSION
    db.close()
    RegistryStore(root, 1 << 20).close()  # opening a migrated store again changes nothing
