"""The registry-restore drill against a real mesh: versions pushed under load, a backup,
one more pushed after it, the registry killed and its store deleted, an empty registry
restored from the backup. Every call is answered throughout; every version and alias of
the backup is back with its sha256 verified; the version pushed after the backup is
named as lost (RPO); the restore's time is measured (RTO); zone-a's model servers,
restarted afterwards, load from the restored registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.test_drills import drill, method_output

pytestmark = pytest.mark.mesh


def test_a_lost_registry_is_restored_from_its_backup(tmp_path: Path) -> None:
    result = drill("registry-restore", tmp_path, fault_s=2)
    assert result.verdict == "held", result.text
    assert method_output(result, "push-versions-under-load") == [
        "fraud/dr-1",
        "fraud/dr-2",
        "fraud/dr-3",
    ]
    backup = method_output(result, "back-up-the-registry")
    back = method_output(result, "what-came-back")
    assert back["ok"], back
    assert back["versions_back"] == back["versions_in_backup"] == backup["versions"]
    assert back["sha256_verified"] == backup["versions"]
    assert back["lost_after_backup"] == ["fraud/late-1"]
    assert back["rto_s"] is not None and back["rto_s"] > 0
    assert back["rpo_s"] is not None and back["rpo_s"] > 0
    restarted = method_output(result, "they-load-from-the-restored-registry")
    assert restarted["restarted"], restarted
    windows = {w["label"]: w for w in result.summary["windows"]}
    lost = windows["registry store lost"]
    assert lost["failed"] == 0 and lost["degraded"] == 0, lost
    report = (result.out_dir / "registry-restore.md").read_text()
    assert "RPO: 1 version(s) lost" in report and "fraud/late-1" in report
