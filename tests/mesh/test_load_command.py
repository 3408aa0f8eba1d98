"""`servemesh load` against the session's running mesh: it sends what it says, reports who
answered, and refuses a model the mesh does not serve, naming the flag."""

from __future__ import annotations

import pytest

from servemesh.cli import main
from servemesh.launcher import Mesh

pytestmark = pytest.mark.mesh


def test_load_sends_its_calls_and_reports_who_answered(
    mesh: Mesh, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["load", "--rate", "40", "--duration", "1s", "--state-dir", str(mesh.state_dir)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "40 Predicts over" in printed
    answered = next(line for line in printed.splitlines() if "answered " in line)
    assert answered.split()[-2] == "40"
    assert "answered by" in printed and "v1" in printed


def test_load_refuses_a_model_the_mesh_does_not_serve(
    mesh: Mesh, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["load", "--model", "nope", "--duration", "1s", "--state-dir", str(mesh.state_dir)])
    assert code == 1
    assert "--model: 'nope' is not served" in capsys.readouterr().err
