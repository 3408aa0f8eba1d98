"""The registry's state: metadata in SQLite, artifacts content-addressed on disk.

Every method is synchronous and short (one SQLite transaction or one file operation); the
asyncio servicer calls them through `asyncio.to_thread`. One connection serves every
thread, guarded by a lock, so transactions never interleave.

Invariant: a version row exists only for an artifact that arrived whole, matched its
declared size and sha256, and was fsynced at its content address. A failed upload leaves
neither a row, nor a blob, nor a temp file.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Literal

from servemesh.contract.private import private_dir, private_file
from servemesh.registry.blobs import BlobStore, StagedBlob
from servemesh.registry.errors import (
    AlreadyExistsError,
    ArtifactTooLargeError,
    BlobMissingError,
    DigestMismatchError,
    InvalidArgumentError,
    NotFoundError,
    QuotaExceededError,
    version_taken,
)
from servemesh.registry.records import ModelRecord, TensorSpec, UploadHeader, VersionRecord
from servemesh.registry.validation import (
    check_description,
    check_header,
    check_name,
)

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY,
    description TEXT NOT NULL,
    created_unix_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    model TEXT NOT NULL REFERENCES models(name),
    version TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    size_bytes INTEGER NOT NULL CHECK (size_bytes > 0),
    format TEXT NOT NULL,
    inputs TEXT NOT NULL,
    outputs TEXT NOT NULL,
    labels TEXT NOT NULL,
    created_unix_ms INTEGER NOT NULL,
    PRIMARY KEY (model, version)
);
CREATE TABLE IF NOT EXISTS aliases (
    model TEXT NOT NULL REFERENCES models(name),
    alias TEXT NOT NULL,
    version TEXT NOT NULL,
    PRIMARY KEY (model, alias),
    FOREIGN KEY (model, version) REFERENCES versions(model, version)
);
"""

# Schema migrations: step i brings a store from PRAGMA user_version i to i + 1, in one
# transaction, when a RegistryStore opens it. Steps only add columns, with defaults, so rows
# written before stay readable (and code that names its columns still reads a newer store).
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: each version's lineage and metrics, as JSON objects.
    (
        "ALTER TABLE versions ADD COLUMN lineage TEXT NOT NULL DEFAULT '{}'",
        "ALTER TABLE versions ADD COLUMN metrics TEXT NOT NULL DEFAULT '{}'",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)

_COLUMNS = (
    "model",
    "version",
    "sha256",
    "size_bytes",
    "format",
    "inputs",
    "outputs",
    "labels",
    "created_unix_ms",
    "lineage",
    "metrics",
)
_VERSION_COLUMNS = ", ".join(_COLUMNS)
_JOINED_VERSION_COLUMNS = ", ".join(f"v.{column}" for column in _COLUMNS)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _specs_json(specs: tuple[TensorSpec, ...]) -> str:
    return json.dumps([spec.to_json() for spec in specs])


def _version_from_row(row: sqlite3.Row) -> VersionRecord:
    return VersionRecord(
        model=row["model"],
        version=row["version"],
        sha256=row["sha256"],
        size_bytes=row["size_bytes"],
        format=row["format"],
        inputs=tuple(TensorSpec.from_json(item) for item in json.loads(row["inputs"])),
        outputs=tuple(TensorSpec.from_json(item) for item in json.loads(row["outputs"])),
        labels=json.loads(row["labels"]),
        created_unix_ms=row["created_unix_ms"],
        lineage=json.loads(row["lineage"]),
        metrics=json.loads(row["metrics"]),
    )


class RegistryStore:
    """Models, versions and aliases under `root`; artifacts up to `max_artifact_bytes`,
    and up to `quota_bytes` stored in all (None: no quota)."""

    def __init__(self, root: Path, max_artifact_bytes: int, quota_bytes: int | None = None) -> None:
        if max_artifact_bytes <= 0:
            raise ValueError("max_artifact_bytes must be positive")
        if quota_bytes is not None and quota_bytes <= 0:
            raise ValueError("quota_bytes must be positive")
        self.root = Path(root)
        self.max_artifact_bytes = max_artifact_bytes
        self.quota_bytes = quota_bytes
        # The registry's files are the mesh user's alone (artifacts are code).
        private_dir(self.root)
        self.blobs = BlobStore(self.root)
        # Only this process writes under root, so whatever temp file exists now is a
        # leftover of a crash.
        swept = self.blobs.sweep_temp()
        if swept:
            log.warning("removed stale upload temp files", extra={"count": swept})
        # RLock: an upload's commit holds it across the transaction and the blob cleanup.
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = sqlite3.connect(
            private_file(self.root / "registry.db"), check_same_thread=False, isolation_level=None
        )
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a version acknowledged to the uploader survives a power cut.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)
        self._migrate()

    def _migrate(self) -> None:
        """Bring the schema up to SCHEMA_VERSION, one transaction per step."""
        with self._transaction() as db:
            current = int(db.execute("PRAGMA user_version").fetchone()[0])
        for target in range(current + 1, SCHEMA_VERSION + 1):
            with self._transaction(write=True) as db:
                for statement in MIGRATIONS[target - 1]:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {target}")
            log.info("registry store migrated", extra={"schema_version": target})

    def close(self) -> None:
        """Close the database; safe to call twice."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    @contextmanager
    def _transaction(self, *, write: bool = False) -> Iterator[sqlite3.Connection]:
        """One transaction, exclusive among this store's threads; rolled back on error."""
        with self._lock:
            if self._db is None:
                raise RuntimeError("registry store is closed")
            db = self._db
            db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                # A failed COMMIT may already have rolled back.
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    # --- reads ---------------------------------------------------------------------

    def _require_model(self, db: sqlite3.Connection, model: str) -> sqlite3.Row:
        row = db.execute("SELECT * FROM models WHERE name = ?", (model,)).fetchone()
        if row is None:
            raise NotFoundError(f"model {model!r} not found")
        return row

    def _model_record(self, db: sqlite3.Connection, row: sqlite3.Row) -> ModelRecord:
        aliases = db.execute(
            "SELECT alias, version FROM aliases WHERE model = ? ORDER BY alias", (row["name"],)
        ).fetchall()
        return ModelRecord(
            name=row["name"],
            description=row["description"],
            aliases={alias["alias"]: alias["version"] for alias in aliases},
            created_unix_ms=row["created_unix_ms"],
        )

    def _find_version(
        self, db: sqlite3.Connection, model: str, ref: str
    ) -> tuple[VersionRecord | None, Literal["version", "alias"] | None]:
        """The version `ref` names, directly or through an alias, and which it was."""
        row = db.execute(
            f"SELECT {_VERSION_COLUMNS} FROM versions WHERE model = ? AND version = ?",
            (model, ref),
        ).fetchone()
        if row is not None:
            return _version_from_row(row), "version"
        row = db.execute(
            f"SELECT {_JOINED_VERSION_COLUMNS} "
            "FROM aliases a JOIN versions v ON v.model = a.model AND v.version = a.version "
            "WHERE a.model = ? AND a.alias = ?",
            (model, ref),
        ).fetchone()
        if row is not None:
            return _version_from_row(row), "alias"
        return None, None

    def get_model(self, name: str) -> ModelRecord:
        """The model with its aliases; NotFoundError when it does not exist."""
        check_name(name, "name")
        with self._transaction() as db:
            return self._model_record(db, self._require_model(db, name))

    def list_models(self) -> list[ModelRecord]:
        """Every model, by name."""
        with self._transaction() as db:
            rows = db.execute("SELECT * FROM models ORDER BY name").fetchall()
            return [self._model_record(db, row) for row in rows]

    def get_version(self, model: str, version: str) -> VersionRecord:
        """The version named `version`, or the one the alias `version` points at.

        A version name wins over an alias of the same name (they cannot be created so,
        see `set_alias` and `begin_upload`).
        """
        check_name(model, "model")
        check_name(version, "version")
        with self._transaction() as db:
            self._require_model(db, model)
            record, _ = self._find_version(db, model, version)
        if record is None:
            raise NotFoundError(f"version or alias {version!r} of model {model!r} not found")
        return record

    def list_versions(self, model: str) -> list[VersionRecord]:
        """A model's versions, oldest first."""
        check_name(model, "model")
        with self._transaction() as db:
            self._require_model(db, model)
            rows = db.execute(
                f"SELECT {_VERSION_COLUMNS} FROM versions WHERE model = ? "
                "ORDER BY created_unix_ms, rowid",
                (model,),
            ).fetchall()
        return [_version_from_row(row) for row in rows]

    def open_artifact(self, record: VersionRecord) -> BinaryIO:
        """The version's artifact opened for reading (the caller closes it)."""
        try:
            return self.blobs.open(record.sha256)
        except FileNotFoundError:
            raise BlobMissingError(
                f"artifact of {record.model}/{record.version} (sha256 {record.sha256}) "
                "is missing from the store"
            ) from None

    # --- writes --------------------------------------------------------------------

    def create_model(self, name: str, description: str = "") -> ModelRecord:
        """A new model without versions; AlreadyExistsError when the name is taken."""
        check_name(name, "name")
        check_description(description, "description")
        with self._transaction(write=True) as db:
            try:
                db.execute(
                    "INSERT INTO models (name, description, created_unix_ms) VALUES (?, ?, ?)",
                    (name, description, _now_ms()),
                )
            except sqlite3.IntegrityError:
                raise AlreadyExistsError(f"model {name!r} already exists") from None
            return self._model_record(db, self._require_model(db, name))

    def set_alias(self, model: str, alias: str, version: str) -> ModelRecord:
        """Point `alias` at `version` (a version name, or an alias whose target is taken).

        Returns the model with its updated aliases.
        """
        check_name(model, "model")
        check_name(alias, "alias")
        check_name(version, "version")
        with self._transaction(write=True) as db:
            self._require_model(db, model)
            target, _ = self._find_version(db, model, version)
            if target is None:
                raise NotFoundError(f"version or alias {version!r} of model {model!r} not found")
            clash = db.execute(
                "SELECT 1 FROM versions WHERE model = ? AND version = ?", (model, alias)
            ).fetchone()
            if clash is not None:
                # Versions and aliases share one namespace in GetVersion/DownloadArtifact.
                raise InvalidArgumentError(
                    f"alias: {alias!r} is a version of model {model!r}; an alias cannot "
                    "shadow a version"
                )
            db.execute(
                "INSERT INTO aliases (model, alias, version) VALUES (?, ?, ?) "
                "ON CONFLICT (model, alias) DO UPDATE SET version = excluded.version",
                (model, alias, target.version),
            )
            return self._model_record(db, self._require_model(db, model))

    def begin_upload(self, header: UploadHeader) -> Upload:
        """Validate the header and open a temp file for the bytes that follow.

        Refuses at once what can be refused before any byte: a malformed header, a
        declared size over the limit, a version that exists with other bytes.
        """
        check_header(header)
        if header.size_bytes > self.max_artifact_bytes:
            raise ArtifactTooLargeError(
                f"header.size_bytes: {header.size_bytes} exceeds the registry limit of "
                f"{self.max_artifact_bytes} bytes"
            )
        with self._transaction() as db:
            self._check_version_free(db, header)
            self._check_quota(db, header)
        return Upload(self, header)

    def stored_bytes(self) -> int:
        """The bytes of every distinct artifact the registry holds (what the quota counts)."""
        with self._transaction() as db:
            return self._stored_bytes(db)

    def _stored_bytes(self, db: sqlite3.Connection) -> int:
        row = db.execute(
            "SELECT COALESCE(SUM(size_bytes), 0) FROM "
            "(SELECT DISTINCT sha256, size_bytes FROM versions)"
        ).fetchone()
        return int(row[0])

    def _check_quota(self, db: sqlite3.Connection, header: UploadHeader) -> None:
        """Refuse an artifact whose bytes would pass the quota (bytes already stored under
        the same sha256 cost nothing more)."""
        if self.quota_bytes is None:
            return
        stored = db.execute(
            "SELECT 1 FROM versions WHERE sha256 = ? LIMIT 1", (header.sha256,)
        ).fetchone()
        if stored is not None:
            return
        used = self._stored_bytes(db)
        if used + header.size_bytes > self.quota_bytes:
            raise QuotaExceededError(
                f"header.size_bytes: {header.size_bytes} more bytes would pass the registry "
                f"quota of {self.quota_bytes} bytes (limits.registry_quota_bytes); "
                f"{used} bytes are used"
            )

    def _check_version_free(
        self, db: sqlite3.Connection, header: UploadHeader
    ) -> VersionRecord | None:
        """The existing identical version, None when the name is free; raises on a clash."""
        existing, kind = self._find_version(db, header.model, header.version)
        if kind == "alias":
            raise AlreadyExistsError(
                f"header.version: {header.version!r} is an alias of model {header.model!r}"
            )
        if existing is not None and existing.sha256 != header.sha256:
            raise AlreadyExistsError(version_taken(header.model, header.version, existing.sha256))
        return existing

    def _commit_version(
        self, header: UploadHeader, staged: StagedBlob
    ) -> tuple[VersionRecord, bool]:
        """Install a sealed, verified blob and insert its row, or leave no trace.

        Returns the record and whether it is new (False: the same bytes were there).
        """
        with self._lock:
            new_blob = False
            try:
                with self._transaction(write=True) as db:
                    existing = self._check_version_free(db, header)
                    if existing is None:
                        # Again here, under the lock: uploads that began together each
                        # passed the first check alone.
                        self._check_quota(db, header)
                    if existing is not None:
                        # The same verified bytes: replacing the file repairs a damaged copy.
                        self.blobs.install(staged, header.sha256)
                        return existing, False
                    record = VersionRecord(
                        model=header.model,
                        version=header.version,
                        sha256=header.sha256,
                        size_bytes=header.size_bytes,
                        format=header.format,
                        inputs=header.inputs,
                        outputs=header.outputs,
                        labels=dict(header.labels),
                        created_unix_ms=_now_ms(),
                        lineage=dict(header.lineage),
                        metrics=dict(header.metrics),
                    )
                    db.execute(
                        "INSERT INTO models (name, description, created_unix_ms) VALUES (?, '', ?) "
                        "ON CONFLICT (name) DO NOTHING",
                        (record.model, record.created_unix_ms),
                    )
                    new_blob = self.blobs.install(staged, header.sha256)
                    db.execute(
                        f"INSERT INTO versions ({_VERSION_COLUMNS}) "
                        f"VALUES ({', '.join('?' * len(_COLUMNS))})",
                        (
                            record.model,
                            record.version,
                            record.sha256,
                            record.size_bytes,
                            record.format,
                            _specs_json(record.inputs),
                            _specs_json(record.outputs),
                            json.dumps(dict(record.labels), sort_keys=True),
                            record.created_unix_ms,
                            json.dumps(dict(record.lineage), sort_keys=True),
                            json.dumps(dict(record.metrics), sort_keys=True),
                        ),
                    )
            except BaseException:
                # Still under the lock: no other upload can have started to reference it.
                if new_blob:
                    self.blobs.remove(header.sha256)
                raise
        return record, True


class Upload:
    """One artifact arriving in chunks: `write` each, then `commit` or `abort`.

    The temp file is created by the first `write`, so an upload abandoned before its first
    byte owns nothing. `abort` is safe at any time and after anything; a failed `write` or
    `commit` aborts by itself. As a context manager, leaving the block without a commit
    aborts.
    """

    def __init__(self, store: RegistryStore, header: UploadHeader) -> None:
        self.header = header
        self.created = False
        self._store = store
        self._staged: StagedBlob | None = None
        # write (in a worker thread) and abort (from a cancelled servicer) may overlap.
        self._lock = threading.Lock()
        self._state: Literal["open", "committing", "committed", "aborted"] = "open"

    @property
    def received_bytes(self) -> int:
        return self._staged.size if self._staged is not None else 0

    def write(self, chunk: bytes) -> None:
        """Append a chunk; refuses (and aborts) as soon as the bytes exceed a limit."""
        with self._lock:
            if self._state != "open":
                raise RuntimeError(f"upload is {self._state}")
            total = self.received_bytes + len(chunk)
            try:
                if total > self._store.max_artifact_bytes:
                    raise ArtifactTooLargeError(
                        f"chunk data exceeds the registry limit of "
                        f"{self._store.max_artifact_bytes} bytes"
                    )
                if total > self.header.size_bytes:
                    raise DigestMismatchError(
                        f"chunk data exceeds header.size_bytes ({self.header.size_bytes})"
                    )
                if self._staged is None:
                    self._staged = self._store.blobs.stage()
                self._staged.write(chunk)
            except BaseException:
                self._abort_locked()
                raise

    def commit(self) -> VersionRecord:
        """Verify size and sha256, fsync, install, insert the row; the version record.

        Re-uploading the bytes of an existing version returns that version (`created` stays
        False). Any failure leaves nothing behind.
        """
        with self._lock:
            if self._state != "open":
                raise RuntimeError(f"upload is {self._state}")
            # From here on this thread owns the temp file: abort() leaves it alone.
            self._state = "committing"
        try:
            staged = self._staged
            if staged is None or staged.size != self.header.size_bytes:
                raise DigestMismatchError(
                    f"chunk data is {self.received_bytes} bytes, header.size_bytes declares "
                    f"{self.header.size_bytes}"
                )
            if staged.hexdigest() != self.header.sha256:
                raise DigestMismatchError("chunk data does not match header.sha256")
            staged.seal()
            record, self.created = self._store._commit_version(self.header, staged)
        except BaseException:
            self._discard()
            self._state = "aborted"
            raise
        # Gone after an install; when the same bytes were already there, surplus.
        self._discard()
        self._state = "committed"
        return record

    def abort(self) -> None:
        """Delete the temp file; a no-op once committed, aborted or committing."""
        with self._lock:
            self._abort_locked()

    def _abort_locked(self) -> None:
        if self._state == "open":
            self._state = "aborted"
            self._discard()

    def _discard(self) -> None:
        if self._staged is not None:
            self._staged.discard()

    def __enter__(self) -> Upload:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()
