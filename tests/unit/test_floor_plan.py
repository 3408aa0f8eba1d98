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
    "scaling_policy",
    "rollout_state",
    "demo",
    "demo_model",
    "atomic",
    "private",
    "model_contract",
    "control_credential",
    "echo",
    "identity",
    "errors",
    "tier_keys",
    "percentiles",
}
SERVICES = {"services.runtime", "services.gateway", "services.feature", "services.model"}
TOOLING = {"procs", "netns", "load", "proxy", "credentials", "observe", "state_dir"}

ALLOWED: dict[str, set[str]] = {
    # the contract
    # the operator's error tree and its exit statuses: every layer's errors subclass it
    "errors": set(),
    "wire": set(),
    "atomic": set(),
    # the one percentile (nearest rank): benchmarks, drills, probes, trace hops
    "percentiles": set(),
    # the state dir's privacy: umask, modes, secrets checked, lock files
    "private": {"errors"},
    "echo": set(),  # caller strings quoted and bounded in error messages
    # where the gateway's tiers find batch answers and flush generations in Redis
    "tier_keys": set(),
    "demo": {"demo_model"},  # torch only when a demo model is built
    "demo_model": set(),
    "policy": {"durations"},
    "durations": set(),
    # what a rollout follows: its steps, analysis, checklist, SLOs and freeze windows
    "rollout_plan": {"durations", "policy"},
    # what a rollout records under <state_dir>/rollouts/: the controller writes it, `rollout
    # status` and the chaos drills read it
    "rollout_state": {"atomic", "private", "rollout_plan", "errors"},
    "spec": {"demo", "policy", "durations", "rollout_plan", "scaling_policy", "errors"},
    # what the scaler holds each pool to: bounds, targets, windows, calendar floors
    "scaling_policy": {"durations", "policy"},
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
    # what a caller presents at the edge: the basic key, or a token signed with the mesh key
    "credentials": {"private", "durations", "wire", "identity", "spec"},
    # the recording rules, as PromQL: the SLIs, and the error budgets of the spec's SLOs
    "slo_rules": CONTRACT,
    # processes, and the mesh's Prometheus (which evaluates slo_rules)
    "procs": CONTRACT | {"slo_rules"},
    # what `up` keeps private in its state dir, and shares with sandboxed model servers
    "state_dir": CONTRACT | {"credentials", "procs"},
    # zone namespaces; a zone's process may run as the sandbox's user (procs.sandbox)
    "netns": CONTRACT | {"procs"},
    "load": CONTRACT,
    "proxy": CONTRACT | {"load", "netns"},
    # reads a running mesh's metrics, its Prometheus and /proc (`servemesh top`, cost)
    "observe": CONTRACT | {"proxy"},
    # running a mesh
    "seeding": CONTRACT | {"registry", "services.feature"},
    # the service catalog (file or Consul), the control plane that turns it into Envoy's
    # endpoint files, and the docker-compose topology's rendered configs
    "discovery": CONTRACT | {"proxy", "procs", "slo_rules"},
    # batch scoring: a view's rows from the feature store, scored with the model server's
    # loader and runner (in process, on a Dask cluster, or through the mesh's model servers,
    # its rows put on the wire as the gateway puts them); artifacts from the registry
    "batch": CONTRACT
    | {"credentials", "registry", "services.feature", "services.gateway", "services.model"},
    # the launcher starts the batch scheduler when the spec has jobs (its ready file)
    "launcher": CONTRACT | TOOLING | {"seeding", "batch", "scaling"},
    # the scaler: signals from the replicas' /metrics, decisions, fleet changes through the
    # route manager (the fleet's own waits: a replica's version health, Envoy's hosts)
    "scaling": CONTRACT | TOOLING | {"rollout", "predlog", "capacity"},
    # the capacity plan's arithmetic and the measurement it keeps (the scaler's forecast
    # reads it)
    "capacity": CONTRACT,
    # the capacity plan's step load, on a mesh of its own
    "capacity_probe": CONTRACT | TOOLING | {"launcher", "bench", "capacity"},
    # what runs meshes and measures them; the chaos suite is imported by the CLI alone
    # (its drills drive `servemesh rollout` as a command, and read the state it records;
    # the registry-restore drill backs the registry up and restores it with its own module)
    "chaos": CONTRACT
    | TOOLING
    | {"launcher", "seeding", "services.runtime", "streams", "registry"},
    # two meshes against each other, and the trace store read for a sampled trace
    "observe_bench": CONTRACT | TOOLING | {"launcher", "tracestore"},
    # the mesh against its own model server (it reads CPU and settles a mesh as observe_bench)
    # and against the echo server, which it starts as bench model does (model_bench)
    "bench": CONTRACT | TOOLING | {"launcher", "observe_bench", "model_bench", "bench_h2load"},
    # bench predict's rows driven by h2load: the edge's outcomes read from its access log,
    # the bench servers' from their counters (model_bench)
    "bench_h2load": CONTRACT | TOOLING | {"model_bench"},
    # py-spy on a mesh of its own under load (set up and settled as bench predict's)
    "profile_bench": CONTRACT | TOOLING | {"launcher", "observe_bench", "bench"},
    # batch scoring against the model in a tight loop, on a registry and Redis of its own
    "batch_bench": CONTRACT | TOOLING | {"batch", "registry", "services.feature", "services.model"},
    # Predicts with the gateway's tiers on and off, on a mesh of its own
    "tiers_bench": CONTRACT | TOOLING | {"launcher", "observe_bench", "bench", "batch"},
    "batch_mesh_bench": CONTRACT | TOOLING | {"launcher", "observe_bench", "bench", "tiers_bench"},
    # fixed and autoscaled meshes under one ramp (the scaler's history, the fleet's waits)
    "scale_bench": CONTRACT
    | TOOLING
    | {"launcher", "bench", "observe_bench", "scaling", "rollout"},
    # one shared Envoy against an Envoy per zone: two meshes measured back to back
    "layout_bench": CONTRACT | TOOLING | {"launcher", "bench", "observe_bench"},
    # a stream consumer on a mesh of its own: events/s and event-to-prediction latency
    "stream_bench": CONTRACT | TOOLING | {"launcher", "bench", "streams"},
    # fuzzes a mesh of its own (launcher) through Envoy and straight to its replicas
    "fuzz": CONTRACT | TOOLING | {"launcher"},
    # (and a bench model's INT8 form, derived as `models quantize` derives it)
    "model_bench": CONTRACT | TOOLING | SERVICES | {"quantize", "registry"},
    # `servemesh rollout`: the controller, its analysis, checklist and gates
    # (the registry's artifact client: the checklist verifies a version's sha256 with it;
    # the error-budget gate reads the budgets slo_rules defines; a derived version is held to
    # the accuracy limits quantize derives under)
    "rollout": CONTRACT | TOOLING | {"registry", "slo_rules", "quantize"},
    # streaming predictions: a Redis stream consumer scoring through the edge, or in process
    # with the model server's loader and the feature store's reads and writes
    "streams": CONTRACT | {"credentials", "services.feature", "services.model"},
    # models on devices: a version exported (ONNX, checked in onnxruntime, or .pt2) with the
    # model server's runner as the original, and an alias's artifact synced to a folder
    "edge": CONTRACT | {"registry", "services.model"},
    # derived versions (dynamic INT8, FP16/BF16): the version's program as edge export reads
    # it, checked through the model server's loader against its source
    "quantize": CONTRACT | {"edge", "registry", "services.model"},
    # loads a user's feature file through a running mesh's feature service (its row checks)
    "features": CONTRACT | {"proxy", "services.feature"},
    # the command line (servemesh/cli/, one module per command group): `compose` and
    # `control-plane` render the containers' topology and seed their registry, `log` reads
    # the prediction log, `models push` checks and probes a model with the model server's
    # own loader before uploading it to the registry
    "cli": CONTRACT
    | TOOLING
    | {
        "launcher",
        "chaos",
        "bench",
        "observe_bench",
        "profile_bench",
        "stream_bench",
        "batch",
        "batch_bench",
        "tiers_bench",
        "batch_mesh_bench",
        "scale_bench",
        "layout_bench",
        "scaling",
        "capacity",
        "capacity_probe",
        "fuzz",
        "model_bench",
        "features",
        "edge",
        "quantize",
        "streams",
        "tracestore",
        "rollout",
        "discovery",
        "seeding",
        "predlog",
        "registry",
        "services.model",
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


# --- what a service process loads ------------------------------------------------------------
#
# ALLOWED reads the import statements one file at a time; a service process loads whatever
# those reach, through package __init__ files and modules of other layers. Each entry below
# is imported in a fresh interpreter and its sys.modules checked.

# A service process's entry modules: `python -m <entry>` (what the launcher, the compose
# files and the trace store's launch run). The trace store's __main__ runs its main() when
# imported, so the module it runs stands in for it.
SERVICE_ENTRIES = sorted(
    [
        *(
            f"servemesh.services.{p.parent.name}.__main__"
            for p in REPO.glob("services/*/__main__.py")
        ),
        "servemesh.registry.__main__",
        "servemesh.tracestore.receiver",
    ]
)

# What no service process may load (a name and every module under it), and why.
NOT_IN_A_SERVICE: dict[str, str] = {
    "servemesh.proxy": "Envoy's renderer, admin API and process: the launcher's and the "
    "control plane's (a service reaches Envoy through the catalog, never renders for it)",
    "consul": "py-consul: only the Consul backend loads it, when the spec's discovery says so",
    "rich": "the command line's tables and colours: a service logs JSON lines",
    "servemesh.rollout": "the rollout controller is a command of its own, not part of a service",
    "servemesh.launcher": "`servemesh up`: it starts services, it is not one",
    "servemesh.procs": "starting and supervising processes (and Prometheus): the launcher's",
    "servemesh.cli": "the command line: a service has its own entry point",
    "servemesh.chaos": "the chaos suite, imported by the command line alone",
    "chaoslib": "chaostoolkit's library, the chaos suite's",
}


def _forbidden(module: str) -> str | None:
    for name in NOT_IN_A_SERVICE:
        if module == name or module.startswith(name + "."):
            return name
    return None


def _import_chain(importtime: str, module: str) -> list[str]:
    """Who imported `module`, from -X importtime's report: each import is printed once it
    has finished, indented one level deeper than the import that asked for it, so the first
    shallower line after a module's is its importer."""
    rows = []
    for line in importtime.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        name = line.rsplit("|", 1)[1]
        if name.strip() == "package":
            continue  # the header
        rows.append((len(name) - len(name.lstrip()), name.strip()))
    for i, (depth, name) in enumerate(rows):
        if name != module:
            continue
        chain = [name]
        for later_depth, later in rows[i + 1 :]:
            if later_depth < depth:
                chain.append(later)
                depth = later_depth
        return chain[::-1]
    return [module]


def leaks_of(entry: str) -> dict[str, str]:
    """What importing `entry` in a fresh interpreter loads of NOT_IN_A_SERVICE: for each,
    the chain of imports that reached it, and why it does not belong."""
    import json
    import subprocess
    import sys

    probe = f"import sys, json, {entry}; print(json.dumps(sorted(sys.modules)))"
    answer = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    leaks: dict[str, str] = {}
    for module in json.loads(answer.stdout):
        name = _forbidden(module)
        if name is not None and name not in leaks:
            chain = " -> ".join(_import_chain(answer.stderr, module))
            leaks[name] = f"{chain} ({NOT_IN_A_SERVICE[name]})"
    return leaks


@pytest.mark.parametrize("entry", SERVICE_ENTRIES)
def test_a_service_process_loads_nothing_of_the_layers_above_it(entry: str) -> None:
    assert leaks_of(entry) == {}, f"{entry} loads what no service should"


def test_every_service_process_is_probed() -> None:
    services = {e.split(".")[2] for e in SERVICE_ENTRIES if e.startswith("servemesh.services.")}
    assert services >= {"gateway", "feature", "model"}, SERVICE_ENTRIES


def test_the_probe_names_the_chain_that_loads_a_leak() -> None:
    # The control plane's endpoint files are rendered by Envoy's renderer: a module that
    # loads it, so the probe must see it and say through what.
    leaks = leaks_of("servemesh.discovery.endpoints")
    assert "servemesh.proxy" in leaks
    assert leaks["servemesh.proxy"].startswith("servemesh.discovery.endpoints -> servemesh.proxy")
