"""Where a batch run's rows go: a Parquet file, a PostgreSQL table or the mesh's Redis.

Each writer stages what it is given chunk by chunk and puts the output in place in one
step at the end, so a reader sees the previous output or the whole new one, never half:

| output | staged as | put in place by |
| --- | --- | --- |
| `FILE.parquet` | one Parquet file per chunk in the run's folder | one file written beside `FILE`, then renamed over it |
| `postgresql://...` | the table `<table>__staging`, a column `_chunk` per row | one transaction: drop `_chunk`, add the primary key, drop `<table>`, rename the staging table |
| `redis` | the keys of a new run number | one SET of the pointer, then the runs before it are deleted |

A resumed run calls `open(..., resuming=True)`: the writer discards whatever it holds from
the checkpoint's `next_chunk` on (written before a crash could record it), so rescoring
those chunks writes each row once.

Rows: the entity's id (a column named after the entity), every output of the model (a
number, or a list of numbers for an output wider than one value per row), then `model`,
`version`, `sha256` (the artifact's) and `scored_at` (UTC, milliseconds).

Redis layout (the precomputed tier reads it): servemesh/contract/tier_keys.py, the one module that
spells it. A run's keys are written under a new run number and the run pointer is set last;
a reader MGETs the entities' keys with the pointer key last and uses the values when the
pointer still names the run it read (runs are deleted only after they stopped being current).
"""  # noqa: E501

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import redis.asyncio as aioredis

from servemesh.batch.checkpoint import Checkpoint, RunDir
from servemesh.batch.errors import BatchError
from servemesh.contract.tier_keys import score_keys
from servemesh.services.feature.store import DELETE_BATCH

RESERVED = ("model", "version", "sha256", "scored_at")
_TABLE = re.compile(r"^[a-z_][a-z0-9_]{0,45}$")


# --- the rows --------------------------------------------------------------------------


def output_schema(entity: str, outputs: Mapping[str, tuple[np.dtype[Any], int]]) -> pa.Schema:
    """The output's columns: `outputs` maps each output to its numpy dtype and values per
    row (1: a number; more: a list)."""
    clash = sorted({entity, *RESERVED} & set(outputs))
    if clash:
        raise BatchError(f"--model: output {clash[0]!r} has the name of a column batch writes")
    fields = [pa.field(entity, pa.string(), nullable=False)]
    for name, (dtype, width) in outputs.items():
        kind = pa.from_numpy_dtype(dtype)
        fields.append(pa.field(name, kind if width == 1 else pa.list_(kind, width)))
    fields += [
        pa.field("model", pa.string()),
        pa.field("version", pa.string()),
        pa.field("sha256", pa.string()),
        pa.field("scored_at", pa.timestamp("ms", tz="UTC")),
    ]
    return pa.schema(fields)


def chunk_table(
    schema: pa.Schema,
    ids: Sequence[str],
    outputs: Mapping[str, np.ndarray],
    *,
    model: str,
    version: str,
    sha256: str,
    scored_at_ms: int,
) -> pa.Table:
    """One chunk's rows in `schema`."""
    n = len(ids)
    if n == 0:
        return schema.empty_table()
    columns: list[pa.Array] = [pa.array(list(ids), pa.string())]
    for name in schema.names[1 : len(schema.names) - len(RESERVED)]:
        field = schema.field(name)
        values = np.ascontiguousarray(outputs[name]).reshape(n, -1)
        if pa.types.is_fixed_size_list(field.type):
            flat = pa.array(values.reshape(-1), field.type.value_type)
            columns.append(pa.FixedSizeListArray.from_arrays(flat, values.shape[1]))
        else:
            columns.append(pa.array(values[:, 0], field.type))
    columns += [
        # One value a chunk: repeated by Arrow, not through a Python list of n strings.
        pa.repeat(pa.scalar(model, pa.string()), n),
        pa.repeat(pa.scalar(version, pa.string()), n),
        pa.repeat(pa.scalar(sha256, pa.string()), n),
        pa.array(np.full(n, scored_at_ms, dtype="datetime64[ms]"), pa.timestamp("ms", tz="UTC")),
    ]
    return pa.Table.from_arrays(columns, schema=schema)


class Writer(Protocol):
    """Stages chunks, then puts the whole output in place."""

    def describe(self) -> str: ...

    async def open(self, checkpoint: Checkpoint, resuming: bool) -> None: ...

    async def write(self, index: int, table: pa.Table) -> None: ...

    async def commit(self, checkpoint: Checkpoint) -> str: ...

    async def discard(self, checkpoint: Checkpoint) -> None: ...

    async def close(self) -> None: ...


# --- Parquet -----------------------------------------------------------------------------


class ParquetOutput:
    """`FILE.parquet`: a part per chunk in the run's folder (what `--resume` continues from)
    and, as the chunks come, the whole output in one staging file beside FILE (a
    dot-name), flushed to disk chunk by chunk; at the end its footer is written, it is
    flushed and renamed over FILE. A resumed run rebuilds the staging file from its parts."""

    def __init__(self, path: Path, run_dir: RunDir, schema: pa.Schema) -> None:
        self.path = path
        self.run_dir = run_dir
        self.schema = schema
        self._handle: BinaryIO | None = None
        self._staging: pq.ParquetWriter | None = None
        self._next = 0  # the chunk the staging file takes next

    def describe(self) -> str:
        return str(self.path)

    def _part(self, index: int) -> Path:
        return self.run_dir.parts / f"{index:08d}.parquet"

    @property
    def _tmp(self) -> Path:
        return self.path.with_name(f".{self.path.name}.staging")

    async def open(self, checkpoint: Checkpoint, resuming: bool) -> None:
        if not self.path.parent.is_dir():
            raise BatchError(f"--out {self.path}: no folder {self.path.parent}")
        self.run_dir.parts.mkdir(mode=0o700, exist_ok=True)
        for part in self.run_dir.parts.glob("*.parquet"):
            if not resuming or int(part.stem) >= checkpoint.next_chunk:
                part.unlink()
        await asyncio.to_thread(self._open_staging, checkpoint.next_chunk if resuming else 0)

    def _open_staging(self, chunks: int) -> None:
        self._handle = open(self._tmp, "wb")  # noqa: SIM115 (closed by commit or close)
        self._staging = pq.ParquetWriter(self._handle, self.schema)
        for index in range(chunks):
            part = self._part(index)
            if not part.is_file():
                raise BatchError(f"chunk {index} of the run is missing ({part})")
            # One file's reader (read_table's dataset machinery costs more than a part's
            # whole read); the part was written in this schema.
            self._staging.write_table(pq.ParquetFile(part).read().cast(self.schema))
        self._next = chunks

    async def write(self, index: int, table: pa.Table) -> None:
        # In a worker thread: the event loop goes on reading the next chunk meanwhile.
        await asyncio.to_thread(self._write_part, index, table)

    def _write_part(self, index: int, table: pa.Table) -> None:
        assert self._staging is not None and self._handle is not None, "open() first"
        if index != self._next:
            raise BatchError(f"chunk {index} written out of order (chunk {self._next} is next)")
        part = self._part(index)
        tmp = part.with_suffix(".tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, part)
        self._staging.write_table(table)
        # Flushed chunk by chunk: the last flush, before the rename, has little left to do.
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._next = index + 1

    async def commit(self, checkpoint: Checkpoint) -> str:
        return await asyncio.to_thread(self._commit, checkpoint)

    def _commit(self, checkpoint: Checkpoint) -> str:
        assert self._staging is not None and self._handle is not None, "open() first"
        if self._next != checkpoint.chunks:
            raise BatchError(f"the run wrote {self._next} of its {checkpoint.chunks} chunks")
        self._staging.close()
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        self._staging = self._handle = None
        os.replace(self._tmp, self.path)
        folder = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
        return str(self.path)

    async def discard(self, checkpoint: Checkpoint) -> None:
        return None  # the parts live in the run's folder, removed with it

    async def close(self) -> None:
        # Not committed (an error, Ctrl-C): the staging file goes; the parts stay.
        if self._handle is not None:
            self._handle.close()
            self._staging = self._handle = None
            self._tmp.unlink(missing_ok=True)


# --- Redis -------------------------------------------------------------------------------


class RedisOutput:
    """The mesh's Redis: one new run number per run, flipped current at the end."""

    def __init__(
        self,
        client: aioredis.Redis,
        key_prefix: str,
        *,
        model: str,
        version: str,
        sha256: str,
        source: str,
        output_names: Sequence[str],
        entity: str,
    ) -> None:
        self.client = client
        self.keys = score_keys(key_prefix, model, version)
        self.model = model
        self.version = version
        self.sha256 = sha256
        self.source = source
        self.output_names = list(output_names)
        self.entity = entity
        self.run = 0

    def describe(self) -> str:
        return f"redis {self.keys.base}"

    async def open(self, checkpoint: Checkpoint, resuming: bool) -> None:
        if resuming:
            self.run = int(checkpoint.stage)
            if not await self.client.exists(self.keys.run(self.run)):
                raise BatchError(
                    f"--out redis: run {self.run} of {self.keys.base} is gone (a later run put its "
                    "output in place); start again without --resume"
                )
            return  # rescored chunks overwrite the same keys: each entity once
        self.run = int(await self.client.incr(self.keys.seq))
        checkpoint.stage = str(self.run)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.sadd(self.keys.runs, self.run)
            pipe.hset(
                self.keys.run(self.run),
                mapping={
                    "model": self.model,
                    "version": self.version,
                    "sha256": self.sha256,
                    "outputs": json.dumps(self.output_names),
                    "entity": self.entity,
                    "source": self.source,
                    "started_at_ms": time.time_ns() // 1_000_000,
                },
            )
            await pipe.execute()

    async def write(self, index: int, table: pa.Table) -> None:
        ids = table.column(0).to_pylist()
        scored = table.column("scored_at").cast(pa.int64()).to_pylist()
        outputs = {name: table.column(name).to_pylist() for name in self.output_names}
        async with self.client.pipeline(transaction=False) as pipe:
            for row, entity in enumerate(ids):
                value = {
                    "outputs": {name: _as_list(values[row]) for name, values in outputs.items()},
                    "scored_at_ms": scored[row],
                }
                pipe.set(
                    self.keys.answer(self.run, entity), json.dumps(value, separators=(",", ":"))
                )
            await pipe.execute()

    async def commit(self, checkpoint: Checkpoint) -> str:
        now = time.time_ns() // 1_000_000
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(
                self.keys.run(self.run),
                mapping={"rows": checkpoint.rows_written, "scored_at_ms": now},
            )
            pipe.set(self.keys.current, self.run)
            await pipe.execute()
        for old in await self.client.smembers(self.keys.runs):
            if int(old) != self.run:
                await self._drop(int(old))
        return f"{self.describe()} run {self.run}"

    async def _drop(self, run: int) -> None:
        pattern = self.keys.answers_pattern(run)
        batch: list[bytes] = []
        async for key in self.client.scan_iter(match=pattern, count=DELETE_BATCH):
            batch.append(key)
            if len(batch) >= DELETE_BATCH:
                await self.client.unlink(*batch)
                batch = []
        if batch:
            await self.client.unlink(*batch)
        await self.client.unlink(self.keys.run(run))
        await self.client.srem(self.keys.runs, run)

    async def discard(self, checkpoint: Checkpoint) -> None:
        if checkpoint.stage:
            current = await self.client.get(self.keys.current)
            if current is None or int(current) != int(checkpoint.stage):
                await self._drop(int(checkpoint.stage))

    async def close(self) -> None:
        return None


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


# --- PostgreSQL --------------------------------------------------------------------------


def table_name(given: str | None, model: str) -> str:
    name = given or f"{model.replace('-', '_')}_scores"
    if not _TABLE.match(name):
        raise BatchError(
            f"--table: {name!r} is not a table name (lower case letters, digits and _, at most 46)"
        )
    return name


def _pg_type(field: pa.Field) -> str:
    kind = field.type
    inner = kind.value_type if pa.types.is_fixed_size_list(kind) else kind
    if pa.types.is_boolean(inner):
        base = "boolean"
    elif pa.types.is_integer(inner):
        base = "bigint"
    elif pa.types.is_floating(inner):
        base = "double precision"
    else:
        base = "text"
    return f"{base}[]" if inner is not kind else base


class PostgresOutput:
    """A PostgreSQL table, replaced whole: the rows go to `<table>__staging` (with the chunk
    of each), and one transaction swaps it in."""

    def __init__(self, dsn: str, table: str, schema: pa.Schema) -> None:
        self.dsn = dsn
        self.table = table
        self.staging = f"{table}__staging"
        self.schema = schema
        self._conn: Any = None

    def describe(self) -> str:
        return f"postgresql table {self.table}"

    async def _connection(self) -> Any:
        import psycopg

        if self._conn is None:
            try:
                self._conn = await psycopg.AsyncConnection.connect(self.dsn)
            except psycopg.OperationalError as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else "failed"
                raise BatchError(f"--out postgresql: cannot connect: {first}") from None
        return self._conn

    async def open(self, checkpoint: Checkpoint, resuming: bool) -> None:
        from psycopg import sql

        conn = await self._connection()
        staging = sql.Identifier(self.staging)
        async with conn.transaction():
            if resuming:
                found = await conn.execute("SELECT to_regclass(%s)", [self.staging])
                if (await found.fetchone())[0] is None:
                    raise BatchError(
                        f"--out postgresql: the staging table {self.staging} is gone; start "
                        "again without --resume"
                    )
                await conn.execute(
                    sql.SQL("DELETE FROM {} WHERE _chunk >= %s").format(staging),
                    [checkpoint.next_chunk],
                )
                return
            columns: list[sql.Composable] = [
                sql.SQL("{} {}").format(sql.Identifier(f.name), sql.SQL(_pg_type(f)))
                for f in self.schema
                if f.name != "scored_at"
            ]
            columns.append(sql.SQL("scored_at timestamptz"))
            columns.append(sql.SQL("_chunk integer NOT NULL"))
            await conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(staging))
            await conn.execute(
                sql.SQL("CREATE TABLE {} ({})").format(staging, sql.SQL(", ").join(columns))
            )
        checkpoint.stage = self.staging

    async def write(self, index: int, table: pa.Table) -> None:
        from psycopg import sql

        conn = await self._connection()
        names = [*table.column_names, "_chunk"]
        columns = [table.column(name).to_pylist() for name in table.column_names]
        statement = sql.SQL("COPY {} ({}) FROM STDIN").format(
            sql.Identifier(self.staging), sql.SQL(", ").join(map(sql.Identifier, names))
        )
        async with conn.transaction():
            async with conn.cursor() as cursor:
                async with cursor.copy(statement) as copy:
                    for row in zip(*columns, strict=True):
                        await copy.write_row((*row, index))

    async def commit(self, checkpoint: Checkpoint) -> str:
        from psycopg import sql

        conn = await self._connection()
        staging, final = sql.Identifier(self.staging), sql.Identifier(self.table)
        entity = sql.Identifier(self.schema.names[0])
        async with conn.transaction():
            await conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN _chunk").format(staging))
            await conn.execute(
                sql.SQL("ALTER TABLE {} ADD PRIMARY KEY ({})").format(staging, entity)
            )
            await conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(final))
            await conn.execute(sql.SQL("ALTER TABLE {} RENAME TO {}").format(staging, final))
            # The key's index keeps the staging name otherwise; the next run reuses it.
            await conn.execute(
                sql.SQL("ALTER INDEX {} RENAME TO {}").format(
                    sql.Identifier(f"{self.staging}_pkey"), sql.Identifier(f"{self.table}_pkey")
                )
            )
        return self.describe()

    async def discard(self, checkpoint: Checkpoint) -> None:
        from psycopg import sql

        conn = await self._connection()
        async with conn.transaction():
            await conn.execute(
                sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(self.staging))
            )

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None
