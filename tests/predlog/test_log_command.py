"""`servemesh log` without a mesh: its arguments checked, naming the option, and an empty
or Parquet-only state dir read."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from servemesh.cli import main
from servemesh.predlog.buffer import predictions_dir
from servemesh.predlog.parquet_store import ParquetStore
from servemesh.predlog.query import parse_entity, parse_since, parse_slowest
from tests.predlog.records import row


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--since", "5x"], "--since"),
        (["--since", "0m"], "--since"),
        (["--slowest", "0%"], "--slowest"),
        (["--slowest", "many"], "--slowest"),
        (["--entity", "c-17"], "--entity"),
        (["--version", "v2"], "--version"),
        (["--limit", "0"], "--limit"),
    ],
)
def test_bad_options_are_refused_naming_the_option(
    args: list[str], option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["log", "query", "--state-dir", str(tmp_path), *args]) == 2
    assert option in capsys.readouterr().err


def test_the_parsers_read_what_an_sre_types() -> None:
    assert parse_since("5m") == 300 and parse_since("1h30m") == 5400 and parse_since("1d") == 86400
    assert parse_slowest("1%") == (1.0, None) and parse_slowest("20") == (None, 20)
    assert parse_entity(" customer = c-17 ") == ("customer", "c-17")


def test_query_and_status_over_a_state_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An empty state dir holds neither a mesh nor its log.
    assert main(["log", "status", "--state-dir", str(tmp_path), "--json"]) == 5
    assert capsys.readouterr().err.strip() == (
        f"error: no running mesh at {tmp_path}: start one with `servemesh up`, or point at a "
        "running one with --state-dir DIR or SERVEMESH_STATE_DIR"
    )
    now = time.time()
    store = ParquetStore(predictions_dir(tmp_path), "gateway-zone-a-0")
    store.write([row(now - 30, request_id="recent"), row(now - 10 * 86400, request_id="old")])
    assert main(["log", "query", "--state-dir", str(tmp_path), "--since", "30d"]) == 0
    shown = capsys.readouterr().out
    # Past the retention (7 days): never shown, though its file (which holds a recent
    # call too) stays until its newest record is old enough; status counts what is stored.
    assert "recent" in shown and "old" not in shown and "1 matching calls" in shown
    assert main(["log", "status", "--state-dir", str(tmp_path), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["rows"], status["files"], status["retention"]) == (2, 1, "7d")
    store.write([row(now - 9 * 86400, request_id="older")])
    assert main(["log", "query", "--state-dir", str(tmp_path), "--since", "30d"]) == 0
    capsys.readouterr()
    assert main(["log", "status", "--state-dir", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == 1  # the old file was deleted
