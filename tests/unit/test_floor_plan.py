"""The floor plan holds: each part of servemesh imports only the parts beneath it.

docs/architecture.md draws the same layers. A new module needs a line in ALLOWED: decide
which layer it belongs to before it grows imports nobody chose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The contract every layer may use: wire names, the spec and its policy, demo names,
# atomic file writes, the control credential, caller strings in errors. It imports
# nothing of ours but itself.
CONTRACT = {
    "wire",
    "spec",
    "policy",
    "durations",
    "rollout_plan",
    "demo",
    "demo_model",
    "atomic",
    "private",
    "model_contract",
    "control_credential",
    "echo",
    "identity",
    "errors",
}
SERVICES = {"services.runtime", "services.gateway", "services.feature", "services.model"}
TOOLING = {"procs", "netns", "load", "proxy", "credentials", "observe", "state_dir"}

ALLOWED: dict[str, set[str]] = {
    # the contract
    # the operator's error tree and its exit statuses: every layer's errors subclass it
    "errors": set(),
    "wire": set(),
    "atomic": set(),
    # the state dir's privacy: umask, modes, secrets checked, lock files
    "private": {"errors"},
    "echo": set(),  # caller strings quoted and bounded in error messages
    "demo": {"demo_model"},  # torch only when a demo model is built
    "demo_model": set(),
    "policy": {"durations"},
    "durations": set(),
    # what a rollout follows: its steps, analysis, checklist, SLOs and freeze windows
    "rollout_plan": {"durations", "policy"},
    "spec": {"demo", "policy", "durations", "rollout_plan", "errors"},
    # does a model's spec entry fit an artifact's signature (apply, loader, gateway)
    "model_contract": {"spec", "wire"},
    # the control credential: services check it, every control caller sends it
    "control_credential": {"wire", "private", "errors"},
    # the mesh's CA and certificates, and how every hop dials and serves TLS
    # (and the edge's token signing key, its JWKS and the tokens it verifies)
    "identity": {
        "spec",
        "policy",
        "durations",
        "demo",
        "demo_model",
        "atomic",
        "private",
        "errors",
    },
    # the services: the runtime under them, the contract, and nothing that runs a mesh
    "services.runtime": CONTRACT | {"discovery"},  # a service joins the catalog
    # (and the feature service's wire format, services/feature/wire.py, to read its answers)
    "services.gateway": CONTRACT | {"services.runtime", "predlog", "services.feature"},
    "services.feature": CONTRACT | {"services.runtime"},
    "services.model": CONTRACT | {"services.runtime", "registry"},  # its artifact client
    "registry": CONTRACT | {"services.runtime"},
    # the prediction log: the gateways write it, `servemesh log` reads it
    "predlog": CONTRACT,
    # the embedded trace store: an OTLP receiver on the service runtime, and its reader
    "tracestore": CONTRACT | {"services.runtime"},
    # libraries for running and driving a mesh, usable without one
    "credentials": {"private"},
    "procs": CONTRACT,
    # what `up` keeps private in its state dir, and shares with sandboxed model servers
    "state_dir": CONTRACT | {"credentials", "procs"},
    "netns": CONTRACT,
    "load": CONTRACT,
    "proxy": CONTRACT | {"load", "netns"},
    # reads a running mesh's metrics, its Prometheus and /proc (`servemesh top`, cost)
    "observe": CONTRACT | {"proxy"},
    # running a mesh
    "seeding": CONTRACT | {"registry", "services.feature"},
    # the service catalog (file or Consul), the control plane that turns it into Envoy's
    # endpoint files, and the docker-compose topology's rendered configs
    "discovery": CONTRACT | {"proxy", "procs"},
    "launcher": CONTRACT | TOOLING | {"seeding"},
    # what runs meshes and measures them; the chaos suite is imported by the CLI alone
    # (and reads a rollout's state while its drill drives `servemesh rollout`)
    "chaos": CONTRACT | TOOLING | {"launcher", "seeding", "services.runtime", "rollout"},
    # two meshes against each other, and the trace store read for a sampled trace
    "observe_bench": CONTRACT | TOOLING | {"launcher", "tracestore"},
    # the mesh against its own model server (it reads CPU and settles a mesh as observe_bench)
    "bench": CONTRACT | TOOLING | {"launcher", "observe_bench"},
    # py-spy on a mesh of its own under load (set up and settled as bench predict's)
    "profile_bench": CONTRACT | TOOLING | {"launcher", "observe_bench", "bench"},
    # fuzzes a mesh of its own (launcher) through Envoy and straight to its replicas
    "fuzz": CONTRACT | TOOLING | {"launcher"},
    "model_bench": CONTRACT | TOOLING | SERVICES,
    "routes_cli": CONTRACT | TOOLING,
    "certs_cli": CONTRACT | TOOLING,
    # `servemesh auth token`: edge tokens signed with the mesh's key
    "auth_cli": CONTRACT | TOOLING,
    "apply_cli": CONTRACT | TOOLING,
    "log_cli": CONTRACT | TOOLING | {"predlog"},
    # `servemesh load`: steady traffic through a running mesh's edge
    "load_cli": CONTRACT | TOOLING,
    # `servemesh rollout`: the controller, its analysis, checklist and gates
    # (the registry's artifact client: the checklist verifies a version's sha256 with it)
    "rollout": CONTRACT | TOOLING | {"registry"},
    # `servemesh control-plane` and `servemesh compose`: seeds the containers' registry
    "compose_cli": CONTRACT | TOOLING | {"discovery", "seeding"},
    # loads a user's feature file through a running mesh's feature service (its row checks)
    "features": CONTRACT | {"proxy", "services.feature"},
    # pushes check and probe a model with the model server's own loader before uploading
    "models_cli": CONTRACT | TOOLING | {"registry", "services.model"},
    "cli": CONTRACT
    | TOOLING
    | {
        "launcher",
        "chaos",
        "bench",
        "observe_bench",
        "profile_bench",
        "fuzz",
        "model_bench",
        "routes_cli",
        "certs_cli",
        "auth_cli",
        "apply_cli",
        "features",
        "models_cli",
        "log_cli",
        "tracestore",
        "compose_cli",
        "rollout",
        "load_cli",
    },
    "__main__": {"cli"},
    # development tools
    "protogen": set(),
    "typecheck": set(),
}


def area_of_file(path: Path) -> str:
    parts = path.relative_to(REPO).parts
    if parts[0] == "services":
        return f"services.{parts[1]}"
    if parts[0] in ("registry", "chaos"):
        return parts[0]
    return parts[1].removesuffix(".py")


def area_of_module(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "servemesh" or len(parts) == 1:
        return None  # third-party, generated code (servemesh_api) or the package root
    if parts[1] == "services" and len(parts) > 2:
        return f"services.{parts[2]}"
    return parts[1]


def imports_by_area() -> dict[str, dict[str, str]]:
    """area -> {imported area: first file that imports it}."""
    found: dict[str, dict[str, str]] = {}
    for folder in ("servemesh", "services", "registry", "chaos"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "__init__.py" and path.parent in (
                REPO / "servemesh",
                REPO / "services",
            ):
                continue
            area = area_of_file(path)
            seen = found.setdefault(area, {})
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    modules = [node.module]
                elif isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                else:
                    continue
                for module in modules:
                    target = area_of_module(module)
                    if target and target != area:
                        seen.setdefault(target, str(path.relative_to(REPO)))
    return found


IMPORTS = imports_by_area()


@pytest.mark.parametrize("area", sorted(IMPORTS))
def test_each_part_imports_only_what_the_floor_plan_allows(area: str) -> None:
    assert area in ALLOWED, f"{area} is not on the floor plan: add it to ALLOWED and the docs"
    extra = {t: where for t, where in IMPORTS[area].items() if t not in ALLOWED[area]}
    assert extra == {}, f"{area} imports what lies above or beside it: {extra}"


def test_the_floor_plan_has_no_cycles() -> None:
    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in ALLOWED.get(start, set()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    assert [a for a in ALLOWED if reaches(a, a, {a})] == []


def test_the_command_line_starts_without_importing_torch() -> None:
    """Every `servemesh` command would pay seconds for torch; only the ones that run a
    model (push, up's demo seeding, the model server) import it, when they run."""
    import subprocess
    import sys

    probe = "import sys, servemesh.cli; print('torch' in sys.modules)"
    answer = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert answer.stdout.strip() == "False"
