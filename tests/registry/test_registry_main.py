"""`python -m servemesh.registry` as the mesh runs it: a real process, health, SIGTERM."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from servemesh.contract.wire import REGISTRY_SERVICE
from servemesh.identity import dial_registry
from servemesh.procs import GrpcHealth, Supervisor
from servemesh.spec import MeshSpec, Ports, dump_spec, resolve
from servemesh_api.registry.v1 import registry_pb2, registry_pb2_grpc


def test_the_registry_process_serves_then_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    spec = resolve(
        MeshSpec(
            ports=Ports.free(),
            state_dir=str(tmp_path / "state"),
        )
    )
    spec_file = tmp_path / "mesh.yaml"
    spec_file.write_text(dump_spec(spec))
    argv = [sys.executable, "-m", "servemesh.registry", "--spec", str(spec_file)]
    argv += ["--instance", "registry-0"]

    with Supervisor(tmp_path) as supervisor:
        # Ready: the registry's own service (not only the server) answers SERVING.
        ready = GrpcHealth(dial_registry(spec), service=REGISTRY_SERVICE)
        registry = supervisor.start("registry", argv, ready=ready, timeout_s=20)
        with dial_registry(spec).channel() as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            assert stub.ListModels(registry_pb2.ListModelsRequest(), timeout=5).models == []
        assert (tmp_path / "state" / "registry" / "registry.db").is_file()

        supervisor.send_signal("registry", signal.SIGTERM)
        assert registry.wait(5) == 0, registry.log_tail()
        assert '"msg": "stopped"' in (tmp_path / "registry.log").read_text()
