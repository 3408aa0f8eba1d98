"""Running the mesh's rules through Prometheus's own rule engine (`promtool test rules`):
the rules file a spec renders, a unit-test suite on series written by the test."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from servemesh.procs.prometheus import promtool_binary
from servemesh.slo_rules import render_rules
from servemesh.spec import MeshSpec

PROMTOOL = promtool_binary()
NO_PROMTOOL = "promtool is not installed (Debian package `prometheus`)"


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    """An input series in promtool's notation, labels sorted."""
    inside = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{inside}}}", "values": values}


def rules_file(tmp_path: Path, spec: MeshSpec) -> Path:
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(render_rules(spec)))
    return rules


def run_rule_tests(
    tmp_path: Path,
    spec: MeshSpec,
    tests: list[dict[str, Any]],
    evaluation_interval: str = "1m",
) -> subprocess.CompletedProcess[str]:
    """`promtool test rules` of `tests` against `spec`'s rules."""
    suite = tmp_path / "rules_test.yml"
    suite.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(rules_file(tmp_path, spec))],
                "evaluation_interval": evaluation_interval,
                "tests": tests,
            }
        )
    )
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, "test", "rules", str(suite)], capture_output=True, text=True, timeout=60
    )
