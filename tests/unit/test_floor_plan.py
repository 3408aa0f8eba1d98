"""The floor plan holds: each part of servemesh imports only the parts beneath it.

docs/architecture.md draws the same layers. A new module needs a line in ALLOWED: decide
which layer it belongs to before it grows imports nobody chose.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# What every layer may use: the shared pieces, the spec and its policies, what a rollout
# records, the mesh's identity. None of it imports anything above it.
CONTRACT = {"contract", "spec", "identity"}
SERVICES = {"services.runtime", "services.gateway", "services.feature", "services.model"}
TOOLING = {"procs", "load", "proxy", "observe", "state"}

ALLOWED: dict[str, set[str]] = {
    # the contract
    # the small shared pieces (servemesh/contract/): the operator's error tree and its exit
    # statuses, wire names, atomic writes, the state dir's privacy (umask, modes, lock
    # files), the one percentile (nearest rank), a model server's in-flight journal, caller
    # strings quoted in errors, the tier keys in Redis, the control credential, the demo's
    # names (torch only when a demo model is built). It imports nothing of ours.
    "contract": set(),
    # the mesh spec (servemesh/spec/): its sections, and the policies it carries (a
    # rollout's steps and gates, what the scaler holds each pool to, durations, whether a
    # model's spec entry fits an artifact's signature)
    "spec": {"contract"},
    # the mesh's CA and certificates, and how every hop dials and serves TLS
    # (and the edge's token signing key, its JWKS and the tokens it verifies)
    "identity": {"spec", "contract"},
    # the services: the runtime under them, the contract, and nothing that runs a mesh
    "services.runtime": CONTRACT | {"catalog"},  # a service joins the catalog
    # (and the feature service's wire format, services/feature/wire.py, to read its answers)
    "services.gateway": CONTRACT | {"services.runtime", "predlog", "services.feature"},
    "services.feature": CONTRACT | {"services.runtime"},
    "services.model": CONTRACT | {"services.runtime", "registry"},  # its artifact client
    # (and the prediction log it reads for the drift of the models with a reference)
    "registry": CONTRACT | {"services.runtime", "predlog"},
    # the service catalog (the file catalog, or Consul with its ACLs), and how a service
    # joins it: beneath the services, which register themselves
    "catalog": CONTRACT,
    # the prediction log: the gateways write it, `servemesh log` reads it
    "predlog": CONTRACT,
    # the embedded trace store: an OTLP receiver on the service runtime, and its reader
    "tracestore": CONTRACT | {"services.runtime"},
    # libraries for running and driving a mesh, usable without one
    # the state dir (servemesh/state/): its layout (each Envoy's watched files, the resolved
    # spec, the routes history) and the one-change-at-a-time lock, the running mesh as a
    # process outside it sees it, what `up` keeps private there and shares with sandboxed
    # model servers (procs.sandbox), the lock a running mesh holds, what a rollout records,
    # what a caller presents at the edge (the basic key, or a token signed with the mesh key)
    "state": CONTRACT | {"procs"},
    # the recording rules, as PromQL: the SLIs, and the error budgets of the spec's SLOs
    "slo_rules": CONTRACT,
    # processes, the mesh's Prometheus (which evaluates slo_rules), and the zones' network
    # namespaces (a zone's process may run as the sandbox's user)
    "procs": CONTRACT | {"slo_rules"},
    # model code in a sandboxed child: the child confines itself and loads through the
    # model server's guard; the caller gets arrays back
    "sandbox": CONTRACT | {"procs", "services.runtime", "services.model"},
    "load": CONTRACT,
    "proxy": CONTRACT | {"load", "procs", "state"},  # a zone Envoy runs in its namespace
    # reads a running mesh's metrics, its Prometheus and /proc (`servemesh top`, cost)
    "observe": CONTRACT | {"proxy", "state"},
    # running a mesh
    "seeding": CONTRACT | {"registry", "services.feature"},
    # the control plane that turns the catalog into Envoy's endpoint files, and the
    # docker-compose topology's rendered configs (with Consul's ACLs)
    "discovery": CONTRACT | {"catalog", "proxy", "procs", "slo_rules", "state"},
    # batch scoring: a view's rows from the feature store, scored with the model server's
    # loader and runner (in process, on a Dask cluster, or through the mesh's model servers,
    # its rows put on the wire as the gateway puts them); artifacts from the registry; the
    # model itself runs in a sandboxed child (in process and on each Dask worker). The
    # scheduler process `up` starts (batch/scheduler.py) finds the running mesh and its
    # resolved spec through the state dir (state.running), not through proxy, so batch
    # stays beneath proxy and the launcher that starts it
    "batch": CONTRACT
    | {
        "state",
        "registry",
        "services.feature",
        "services.gateway",
        "services.model",
        "sandbox",
    },
    # the launcher starts the batch scheduler when the spec has jobs (its ready file)
    # and quarantines a version whose calls keep crashing its model servers
    "launcher": CONTRACT | TOOLING | {"seeding", "batch", "scaling", "quarantine"},
    # crash records, the quarantine decision and list; traffic moved by the route manager
    "quarantine": CONTRACT | {"proxy", "state"},
    # the scaler: signals from the replicas' /metrics, decisions, fleet changes through the
    # route manager (the fleet's own waits: a replica's version health, Envoy's hosts)
    "scaling": CONTRACT | TOOLING | {"rollout", "predlog", "capacity"},
    # the capacity plan's arithmetic and the measurement it keeps (the scaler's forecast
    # reads it)
    "capacity": CONTRACT,
    # what runs meshes and measures them; the chaos suite is imported by the CLI alone
    # (its drills drive `servemesh rollout` as a command, and read the state it records;
    # the registry-restore drill backs the registry up and restores it with its own module;
    # a container drill renders its compose project as `compose init` does, with discovery's;
    # the feature-data-loss drill backs the feature store up and restores it with features')
    "chaos": CONTRACT
    | TOOLING
    | {"launcher", "seeding", "services.runtime", "streams", "registry", "discovery", "features"},
    # the benchmarks (servemesh/bench/): each runs what it measures on a mesh of its own
    # (launcher) or as bare servers (the services' own servicers, the model server's
    # loader, batch scoring on a registry and Redis of its own), with its peer (Triton, the
    # echo server) in the same run; the trace store read for a sampled trace, the scaler's
    # history under a ramp, a stream consumer's events/s, a bench model's INT8 form derived
    # as `models quantize` derives it, the capacity plan's step load
    "bench": CONTRACT
    | TOOLING
    | SERVICES
    | {
        "launcher",
        "tracestore",
        "batch",
        "registry",
        "scaling",
        "rollout",
        "streams",
        "quantize",
        "capacity",
    },
    # fuzzes a mesh of its own (launcher) through Envoy and straight to its replicas
    "fuzz": CONTRACT | TOOLING | {"launcher"},
    # `servemesh rollout`: the controller, its analysis, checklist and gates
    # (the registry's artifact client: the checklist verifies a version's sha256 with it;
    # the error-budget gate reads the budgets slo_rules defines; a derived version is held to
    # the accuracy limits quantize derives under)
    "rollout": CONTRACT | TOOLING | {"registry", "slo_rules", "quantize"},
    # streaming predictions: a Redis stream consumer scoring through the edge, or without
    # it, the model in a sandboxed child loaded as a batch run loads it (batch.scorer), with
    # the feature store's reads and writes
    "streams": CONTRACT | {"state", "services.feature", "services.model", "batch"},
    # models on devices: a version exported (ONNX, checked in onnxruntime, or .pt2) with the
    # model server's runner as the original, and an alias's artifact synced to a folder
    # (the model, torch's export of it and the export's check run in a sandboxed child)
    "edge": CONTRACT | {"registry", "services.model", "sandbox"},
    # derived versions (dynamic INT8, FP16/BF16): the version's program as edge export reads
    # it, checked through the model server's loader against its source
    # (derived and checked in sandboxed children)
    "quantize": CONTRACT | {"edge", "registry", "services.model", "sandbox"},
    # loads a user's feature file through a running mesh's feature service (its row checks)
    "features": CONTRACT | {"proxy", "services.feature"},
    # backups of every store a mesh keeps and their restore: the registry's snapshots, the
    # feature store's keys, the prediction log's files, the routes through the route manager
    "recovery": CONTRACT | {"registry", "features", "predlog", "proxy", "state"},
    # the command line (servemesh/cli/, one module per command group): `compose` and
    # `control-plane` render the containers' topology and seed their registry, `log` reads
    # the prediction log, `models push` checks and probes a model with the model server's
    # own loader, in a sandboxed child, before uploading it to the registry
    "cli": CONTRACT
    | TOOLING
    | {
        "sandbox",
        "launcher",
        "chaos",
        "bench",
        "batch",
        "scaling",
        "capacity",
        "fuzz",
        "features",
        "recovery",
        "edge",
        "quantize",
        "streams",
        "tracestore",
        "rollout",
        "discovery",
        "catalog",
        "seeding",
        "predlog",
        "registry",
        "services.model",
        "quarantine",
    },
    "__main__": {"cli"},
    # development tools: the protobuf code generator, the type check
    "dev": set(),
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


def product_files() -> list[Path]:
    """The product's modules, package roots' __init__ files aside."""
    return [
        path
        for folder in ("servemesh", "services", "registry", "chaos")
        for path in sorted((REPO / folder).rglob("*.py"))
        if not (
            path.name == "__init__.py" and path.parent in (REPO / "servemesh", REPO / "services")
        )
    ]


# Parsing every module takes a second: done once, by the first test that needs it, never
# while pytest collects (every worker collects every module).
@functools.cache
def imports_by_area() -> dict[str, dict[str, str]]:
    """area -> {imported area: first file that imports it}."""
    found: dict[str, dict[str, str]] = {}
    for path in product_files():
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


@pytest.mark.parametrize("area", sorted({area_of_file(path) for path in product_files()}))
def test_each_part_imports_only_what_the_floor_plan_allows(area: str) -> None:
    assert area in ALLOWED, f"{area} is not on the floor plan: add it to ALLOWED and the docs"
    imports = imports_by_area()[area]
    extra = {t: where for t, where in imports.items() if t not in ALLOWED[area]}
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
        "servemesh.registry.mirror",
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
