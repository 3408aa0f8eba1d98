"""Scheduled batch jobs: the spec's `batch:` list, when a job is due (an injected clock, no
waiting), and `servemesh batch run-due` / `batch run` end to end into Parquet against the
real registry and Redis, each run recorded under the job's name."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from servemesh.batch.history import RunRecord, read_history
from servemesh.batch.schedule import decide, job_lock, last_fire, next_fire, ready_path, to_ms
from servemesh.contract.control_credential import control_metadata
from servemesh.registry.client import set_alias
from servemesh.spec import BatchJobSpec, MeshSpec, parse_spec
from tests.batch.conftest import StartBatchMesh


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def nightly(**changes: Any) -> BatchJobSpec:
    fields: dict[str, Any] = {
        "name": "nightly",
        "model": "fraud",
        "output": "scores.parquet",
        "schedule": "0 2 * * *",
    }
    return BatchJobSpec(**(fields | changes))


def ran(started: str, job: str = "nightly", status: str = "ok") -> RunRecord:
    ms = to_ms(at(started))
    return RunRecord(job=job, model="fraud", version="v1", sha256="ab" * 32, rows=1,
                     seconds=0.1, output="x", source="y", started_at_ms=ms,
                     finished_at_ms=ms + 100, status=status)  # fmt: skip


def test_slots_are_the_schedules_fire_times_in_utc() -> None:
    assert last_fire("0 2 * * *", at("2030-01-02T02:00:00")) == at("2030-01-02T02:00:00")
    assert last_fire("0 2 * * *", at("2030-01-02T01:59:59")) == at("2030-01-01T02:00:00")
    assert last_fire("0 2 * * *", at("2030-01-02T02:00:00.900")) == at("2030-01-02T02:00:00")
    assert next_fire("0 2 * * *", at("2030-01-02T02:00:00")) == at("2030-01-03T02:00:00")
    assert next_fire("@hourly", at("2030-01-02T02:10:00")) == at("2030-01-02T03:00:00")


def test_a_job_is_due_once_per_slot_since_its_last_run() -> None:
    job = nightly()
    now = at("2030-01-02T02:00:30")
    assert decide(job, [], now).due  # never ran
    assert not decide(job, [ran("2030-01-02T02:00:00")], now).due  # ran in this slot
    assert decide(job, [ran("2030-01-02T01:59:00")], now).due  # ran before the slot
    # Later the same day: not due; the next day's slot: due.
    later = decide(job, [ran("2030-01-02T02:00:05")], at("2030-01-02T23:59:00"))
    assert not later.due and later.next_at == at("2030-01-03T02:00:00")
    assert decide(job, [ran("2030-01-02T02:00:05")], at("2030-01-03T02:00:00")).due
    # Three slots missed: one run covers them, not three.
    records = [ran("2030-01-01T02:00:00"), ran("2030-01-04T09:00:00")]
    assert not decide(job, records, at("2030-01-04T10:00:00")).due
    # A failed run is the slot's run; other jobs' runs do not count.
    assert not decide(job, [ran("2030-01-02T02:00:01", status="failed")], now).due
    assert decide(job, [ran("2030-01-02T02:00:01", job="other")], now).due


def test_the_spec_checks_each_job() -> None:
    ok = MeshSpec(batch=[nightly(schedule="@daily"), nightly(name="hourly", schedule="5 * * * *")])
    assert [j.schedule for j in ok.batch] == ["@daily", "5 * * * *"]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"schedule": "every night"}, "five cron fields"),
        ({"schedule": "61 2 * * *"}, "not a valid cron expression"),
        ({"schedule": "0 0 2 * * *"}, "five cron fields"),
        ({"schedule": "@sometimes"}, "not one of"),
        ({"version": "v1", "alias": "production"}, "give one, not both"),
        ({"view": "user", "entities": "ids.csv"}, "give one, not both"),
        ({"output": "scores.csv"}, "not a .parquet file"),
        ({"table": "t"}, "only with a postgresql"),
        ({"surprise": 1}, "Extra inputs are not permitted"),
    ]
    for changes, message in bad:
        with pytest.raises(ValidationError, match=message):
            nightly(**changes)
    for job, message in [
        (nightly(model="ghost"), "is not one of models"),
        (nightly(version="v9"), "is not a version of"),
        (nightly(view="item"), "model 'fraud' reads"),
    ]:
        with pytest.raises(ValidationError, match=message):
            MeshSpec(batch=[job])
    with pytest.raises(ValidationError, match="names used more than once"):
        MeshSpec(batch=[nightly(), nightly()])
    parsed = parse_spec(
        "batch:\n  - {name: n, model: fraud, output: redis, schedule: '0 2 * * *'}\n"
    )
    assert parsed.batch_job("n").output == "redis"


def test_a_held_job_lock_is_refused_to_a_second_holder(tmp_path: Path) -> None:
    with job_lock(tmp_path, "nightly") as first:
        assert first
        with job_lock(tmp_path, "nightly") as second:
            assert not second
        with job_lock(tmp_path, "other") as other:
            assert other
    with job_lock(tmp_path, "nightly") as again:
        assert again


def test_batch_history_o_json_prints_the_tables_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from servemesh.batch.history import record_run
    from servemesh.cli import main

    record_run(tmp_path, ran("2026-05-01T02:00:00"))
    failed = ran("2026-05-02T02:00:00", job="", status="failed")
    record_run(tmp_path, RunRecord(**{**vars(failed), "error": "no view"}))
    where = ["--state-dir", str(tmp_path)]
    assert main(["batch", "history", *where, "-o", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [(r["job"], r["status"], r["error"]) for r in shown] == [
        ("nightly", "ok", ""),
        (None, "failed", "no view"),
    ]
    assert shown[0]["finished"] == "2026-05-01T02:00:00.100000Z"
    assert shown[0]["sha256"] == "ab" * 32 and shown[0]["rows"] == 1
    assert main(["batch", "history", *where, "--job", "nightly", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 1
    # The table as before: the sha256 cut short, the error beside the status.
    assert main(["batch", "history", *where]) == 0
    table = capsys.readouterr().out
    assert "2026-05-01 02:00:00" in table and "abababababab " in table
    assert "failed: no view" in table


async def test_run_due_runs_a_due_job_into_parquet_and_records_it(
    start_mesh: StartBatchMesh, tmp_path: Path
) -> None:
    out = tmp_path / "nightly.parquet"
    job = nightly(output=str(out), chunk_rows=300, alias="production")
    job_v1 = nightly(name="hourly-v1", version="v1", output=str(tmp_path / "v1.parquet"),
                     schedule="0 * * * *")  # fmt: skip
    mesh = await start_mesh(batch=[job, job_v1])
    loaded = await mesh.load_view(700)
    await set_alias(mesh.registry, "fraud", "production", "v2",
                    credential=control_metadata(mesh.token))  # fmt: skip

    code, stdout, stderr = await mesh.cli("batch", "run-due", "--now", "2030-01-02T02:00:30Z")
    assert code == 0, stderr
    assert "nightly: due (never ran)" in stdout and "hourly-v1: due (never ran)" in stdout
    table = pq.read_table(out)
    assert sorted(table.column("user").to_pylist()) == sorted(loaded["ids"])
    assert set(table.column("version").to_pylist()) == {"v2"}
    history = read_history(mesh.state_dir, "nightly")
    assert [(r.status, r.rows, r.version, r.output) for r in history] == [
        ("ok", 700, "v2", str(out))
    ]
    assert history[0].started_at_ms == to_ms(at("2030-01-02T02:00:30"))
    assert len(history[0].sha256) == 64 and history[0].seconds > 0

    # An hour later: the hourly job is due, the nightly one is not.
    out.unlink()
    code, stdout, stderr = await mesh.cli("batch", "run-due", "--now", "2030-01-02T03:00:00Z")
    assert code == 0, stderr
    assert "nightly: not due" in stdout and "hourly-v1: due" in stdout
    assert not out.exists()
    # `batch run` runs a job now, due or not.
    code, stdout, stderr = await mesh.cli("batch", "run", "nightly", "--progress", "off")
    assert code == 0, stderr
    assert "scored 700 rows with fraud v2" in stdout and out.exists()

    code, stdout, _ = await mesh.cli("batch", "history", "--job", "nightly")
    lines = [line for line in stdout.splitlines() if "nightly" in line]
    assert len(lines) == 2 and all(" ok " in line and "v2" in line for line in lines)
    records = [json.loads(line) for line in (mesh.state_dir / "batch" / "history.jsonl")
               .read_text().splitlines()]  # fmt: skip
    assert sorted(r["job"] for r in records) == ["hourly-v1", "hourly-v1", "nightly", "nightly"]

    code, _, stderr = await mesh.cli("batch", "run", "ghost")
    assert code == 1 and "no batch job named 'ghost'" in stderr


async def test_the_scheduler_up_starts_runs_a_due_job_and_stops_on_sigterm(
    start_mesh: StartBatchMesh, tmp_path: Path
) -> None:
    out = tmp_path / "hourly.parquet"
    mesh = await start_mesh(batch=[nightly(name="hourly", output=str(out), schedule="@hourly")])
    await mesh.load_view(50)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "servemesh.batch.scheduler", "--state-dir", str(mesh.state_dir),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        # Never ran: due at once; then it waits for the next hour (and says so).
        assert proc.stderr is not None
        seen = b""
        while b"next batch slot at" not in seen:
            line = await asyncio.wait_for(proc.stderr.readline(), timeout=90)
            assert line, f"the scheduler exited: {seen.decode()}"
            seen += line
        records = read_history(mesh.state_dir, "hourly")
        assert [(r.status, r.rows) for r in records] == [("ok", 50)] and out.exists()
        assert ready_path(mesh.state_dir).exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, err.decode()
    assert len(read_history(mesh.state_dir, "hourly")) == 1
