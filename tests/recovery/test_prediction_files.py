"""The prediction log's part of a backup, on files named as the gateways name them: what
is held is left, what was lost is put back beside the gateway's folder, a gateway that
numbered its flushes from 1 again keeps its new files, and a changed copy is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from servemesh.predlog.parquet_store import live_files
from servemesh.recovery.checksums import BackupDamaged
from servemesh.recovery.predictions import (
    back_up_predictions,
    restore_predictions,
    verify_predictions,
)


def put(root: Path, gateway: str, first: int, last: int, lo: int, hi: int) -> Path:
    folder = root / gateway
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{first:012d}-{last:012d}_{lo}_{hi}.parquet"
    path.write_bytes(f"{gateway} {first}-{last} {lo}-{hi}".encode())
    return path


def names(root: Path) -> set[str]:
    return {f"{f.path.parent.name}/{f.path.name}" for f in live_files(root)}


def test_lost_files_come_back_beside_the_gateway_and_held_or_merged_ones_stay(
    tmp_path: Path,
) -> None:
    root, part = tmp_path / "predictions", tmp_path / "bk"
    put(root, "gateway-a-0", 1, 1, 1000, 1100)
    put(root, "gateway-a-0", 2, 2, 1100, 1200)
    lost = put(root, "gateway-b-0", 1, 1, 1000, 1150)
    taken = back_up_predictions(root, part)
    assert taken.files == 3 and part.stat().st_mode & 0o077 == 0

    # Since: gateway-a merged its two files; gateway-b lost its folder, started again from
    # flush 1 and wrote a new file (later records under the same flush number).
    for path in (root / "gateway-a-0").iterdir():
        path.unlink()
    put(root, "gateway-a-0", 1, 2, 1000, 1200)
    lost.unlink()
    put(root, "gateway-b-0", 1, 1, 5000, 5100)

    done = restore_predictions(part, root, verify_predictions(part))
    assert (done.files, done.already_there) == (1, 2)
    assert names(root) == {
        "gateway-a-0/000000000001-000000000002_1000_1200.parquet",
        "gateway-b-0/000000000001-000000000001_5000_5100.parquet",
        "gateway-b-0.restored/000000000001-000000000001_1000_1150.parquet",
    }
    again = restore_predictions(part, root, verify_predictions(part))
    assert (again.files, again.already_there) == (0, 3)


def test_a_changed_copy_is_refused_before_anything_is_put_back(tmp_path: Path) -> None:
    root, part = tmp_path / "predictions", tmp_path / "bk"
    put(root, "gateway-a-0", 1, 1, 1000, 1100)
    back_up_predictions(root, part)
    (part / "gateway-a-0" / "000000000001-000000000001_1000_1100.parquet").write_bytes(b"x")
    with pytest.raises(BackupDamaged, match="sha256"):
        verify_predictions(part)
