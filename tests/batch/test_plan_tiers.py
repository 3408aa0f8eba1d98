"""`servemesh batch plan-tiers`: the top entities of a real prediction log (Parquet files
written by the gateways' store) as the entities file a batch job scores next."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from servemesh.batch.source import read_entity_file
from servemesh.cli import main
from servemesh.predlog.buffer import predictions_dir
from servemesh.predlog.parquet_store import ParquetStore
from servemesh.predlog.record import Row
from tests.predlog.records import row

SPEC = """
models:
  fraud: {{}}
batch:
  - {{name: hot, model: fraud, entities: {hot}, entity_column: id, output: redis,
      schedule: "@daily"}}
  - {{name: nightly, model: fraud, output: redis, schedule: "@daily"}}
"""


def _traffic(now: float) -> list[Row]:
    """user-k named 2**(5-k) times (k = 0..5): 32, 16, 8, 4, 2, 1 calls; and older ones."""
    rows = [
        row(now - 120 - i, request_id=f"u{k}-{i}", entity_ids=(f"user-{k}",))
        for k in range(6)
        for i in range(2 ** (5 - k))
    ]
    # Older than --since: user-5 would lead with them.
    rows += [
        row(now - 3 * 86400 - i, request_id=f"old{i}", entity_ids=("user-5",)) for i in range(99)
    ]
    return rows


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    ParquetStore(predictions_dir(state), "gateway-zone-a-0").write(_traffic(time.time()))
    ParquetStore(predictions_dir(state), "gateway-zone-b-0").write(
        [row(time.time() - 300, request_id="b", entity_ids=("user-3",))]
    )
    return state


def test_the_top_entities_go_to_a_file_a_job_scores(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "top.csv"
    args = ["batch", "plan-tiers", "fraud", "--top", "3", "--since", "1d"]
    assert main([*args, "--out", str(out), "--state-dir", str(state_dir)]) == 0
    printed = capsys.readouterr().out
    # 63 + 1 lookups in the day: 32, 16 and 8 of them by the top three.
    assert "user-0" in printed and "user-2" in printed and "user-3" not in printed
    assert "50.0%" in printed and "75.0%" in printed and "87.5%" in printed
    assert "wrote 3 of 6 user ids" in printed and "56 of 64 user lookups" in printed
    assert out.read_text() == "user\nuser-0\nuser-1\nuser-2\n"
    assert read_entity_file(out, None, "user").ids == ["user-0", "user-1", "user-2"]

    # --job: the file the job names, under its entity_column; the default --since (7d)
    # counts user-5's older calls too.
    hot = tmp_path / "hot.csv"
    spec = tmp_path / "mesh.yaml"
    spec.write_text(SPEC.format(hot=hot))
    job = [*args[:3], "--top", "4", "--job", "hot", "--spec", str(spec)]
    assert main([*job, "--state-dir", str(state_dir)]) == 0
    assert read_entity_file(hot, "id", "user").ids == ["user-5", "user-0", "user-1", "user-2"]
    assert "156 of 163 user lookups" in capsys.readouterr().out


def test_plan_tiers_o_json_prints_every_id_written_and_what_they_cover(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "top.csv"
    args = ["batch", "plan-tiers", "fraud", "--top", "3", "--since", "1d", "--show", "1"]
    assert main([*args, "--out", str(out), "--state-dir", str(state_dir), "-o", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["id"], r["calls"], r["covered"]) for r in shown["top"]] == [
        (1, "user-0", 32, 0.5),
        (2, "user-1", 16, 0.75),
        (3, "user-2", 8, 0.875),
    ]
    assert (shown["entity"], shown["written"], shown["distinct"]) == ("user", 3, 6)
    assert (shown["covered_lookups"], shown["lookups"], shown["file"]) == (56, 64, str(out))
    assert out.read_text() == "user\nuser-0\nuser-1\nuser-2\n"


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--top", "3"], "give --job NAME"),
        (["--top", "3", "--job", "hot", "--out", "x.csv"], "give --job NAME"),
        (["--top", "0", "--out", "x.csv"], "--top"),
        (["--top", "3", "--since", "7x", "--out", "x.csv"], "--since"),
        (["--top", "3", "--job", "nightly"], "scores a whole view"),
        (["--top", "3", "--job", "nobody"], "no batch job named 'nobody'"),
    ],
)
def test_refusals_name_the_option(
    extra: list[str],
    said: str,
    state_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = tmp_path / "mesh.yaml"
    spec.write_text(SPEC.format(hot=tmp_path / "hot.csv"))
    command = ["batch", "plan-tiers", "fraud", *extra, "--spec", str(spec)]
    assert main([*command, "--state-dir", str(state_dir)]) == 2
    assert said in capsys.readouterr().err


def test_no_calls_of_the_model_write_nothing(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "top.csv"
    command = ["batch", "plan-tiers", "fraud", "--top", "3", "--since", "1m", "--out", str(out)]
    assert main([*command, "--state-dir", str(state_dir)]) == 1
    assert "no calls of fraud" in capsys.readouterr().err and not out.exists()
