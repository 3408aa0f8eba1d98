"""`servemesh up --netns` removes its namespaces, links and chains when sent SIGTERM.

The mesh runs as a child process on free ports; once it is up (endpoints.json written) its
zones' network exists under its PID, it answers a prediction through that network, and its
zones' services hold no capability. SIGTERM, and nothing with its PID is left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from servemesh.procs import Check, Supervisor
from tests.mesh.conftest import test_mesh_spec
from tests.netns.helpers import capabilities, needs_netns, owned_by


@needs_netns
@pytest.mark.mesh
def test_up_netns_closes_its_network_on_sigterm(tmp_path: Path) -> None:
    state = tmp_path / "state"
    spec_path = tmp_path / "mesh.yaml"
    spec = test_mesh_spec(str(state), entities=50)
    spec_path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    endpoints = state / "endpoints.json"
    argv = [sys.executable, "-m", "servemesh", "up", "--netns", "--spec", str(spec_path)]
    with Supervisor(tmp_path / "logs") as supervisor:
        up = supervisor.start("up", argv, ready=Check(endpoints.exists, "endpoints.json"),
                              timeout_s=180)  # fmt: skip
        running = owned_by(up.pid)
        # The core and two zones, the machine's link, four NAT chains and a filter chain.
        assert len(running) == 3 + 1 + 5, running
        pids = json.loads(endpoints.read_text())["pids"]
        for name in ("gateway-zone-a-0", "feature-zone-b-0", "model-fraud-zone-a-0"):
            caps = capabilities(pids[name])
            assert caps["CapEff"] == caps["CapBnd"] == "0000000000000000", (name, caps)
        predicted = subprocess.run(
            [sys.executable, "-m", "servemesh", "predict", "--model", "fraud", "--entity",
             "user-7", "--json", "--state-dir", str(state)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert predicted.returncode == 0, predicted.stderr
        assert json.loads(predicted.stdout)["model_version"] == "v1"

        assert supervisor.stop("up", grace_s=60) == 0
    assert owned_by(up.pid) == []
