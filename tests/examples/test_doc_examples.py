# ruff: noqa: E501  (NOT_RUN and RUNS hold the docs' commands verbatim, long lines included)
"""Every console example of README.md, examples/wine/README.md, docs/*.md and docs/runbooks/,
run or listed.

The examples are read from the docs themselves: each `$ servemesh ...` line of a ```console
block, and each grpcurl line of a ```console or ```sh block. Each one is either

- run (`RUNS`): on one mesh this module starts with `servemesh up` (free ports, a state dir
  of its own, the examples' own working folder), in the order of `RUNS`, then checked
  against the output the doc shows: the exit code, and the output's shape (table column
  names, the first cell of each table row (service, instance and model names), JSON field
  names, and every other line with its numbers, ids, hashes and times left free); or
- listed (`NOT_RUN`), with the reason it does not run here (hours of load, another host,
  Docker, root, a mesh of another spec) and, where one exists, the test that covers it.

A console example in neither fails `test_every_example_is_run_or_listed`, and so does a
listed one that no doc holds any more: a new example is checked or consciously listed.

Without grpcurl, a grpcurl example's request JSON is checked against the proto instead (its
field names exist in the method's request message), and the test says so in a warning.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format, symbol_database

from servemesh.procs import Check, Supervisor
from servemesh.spec import MeshSpec, Ports
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
DOCS = [
    REPO / "README.md",
    REPO / "examples/wine/README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "docs" / "runbooks").glob("*.md")),
]

pytestmark = pytest.mark.timeout(400)
# How long a polled run is tried again until it prints what its examples show.
POLL_S = 30.0


# --- reading the examples out of the docs --------------------------------------------------


@dataclass(frozen=True)
class Example:
    doc: str  # relative to the repository
    line: int  # of the command's first line
    command: str  # as written, continuation lines joined, a trailing `# comment` dropped
    output: tuple[str, ...]  # the lines the doc shows after it (console blocks only)

    @property
    def key(self) -> str:
        return f"{self.doc}: {self.command}"

    @property
    def program(self) -> str:
        return Path(self.command.split()[0]).name


def _complete(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return False
    return not command.endswith("\\")


def _clean(command: str) -> str:
    command = re.sub(r"\s*\\?\n\s*", " ", command)
    return re.sub(r"\s{2,}#.*$", "", command).strip()


def _is_example(command: str, block: str) -> bool:
    program = Path(command.split()[0]).name if command.split() else ""
    return program == "grpcurl" or (block == "console" and program == "servemesh")


def examples_of(path: Path) -> list[Example]:
    found: list[Example] = []
    lines = path.read_text().splitlines()
    block: str | None = None
    i = 0
    while i < len(lines):
        text = lines[i]
        if text.startswith("```"):
            block = text[3:].strip() if block is None else None
            i += 1
            continue
        stripped = text.strip()
        command = None
        if block == "console" and stripped.startswith("$ "):
            command = stripped[2:]
        elif block in ("sh", "bash", "shell") and not stripped.startswith("#"):
            command = stripped
        if command is None or not _is_example(command, block or ""):
            i += 1
            continue
        first = i
        while not _complete(command) and i + 1 < len(lines):
            i += 1
            command += "\n" + lines[i].strip()
        i += 1
        output: list[str] = []
        if block == "console":
            while i < len(lines) and not lines[i].startswith(("```", "$ ")):
                output.append(lines[i])
                i += 1
        doc = str(path.relative_to(REPO))
        found.append(Example(doc, first + 1, _clean(command), tuple(output)))
    return found


def all_examples() -> list[Example]:
    return [example for doc in DOCS for example in examples_of(doc)]


# --- the output's shape --------------------------------------------------------------------


def _is_border(line: str) -> bool:
    return all(c == " " or "\u2500" <= c <= "\u257f" for c in line)


_FREE = [
    r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b",  # request ids
    r"\b[0-9a-f]{12,64}\b",  # hashes, trace ids
    r"\b\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:Z|\s+UTC)?",  # times
    r"(?<![\w.])-?\d[\w.:,/%]*",  # numbers, addresses, sizes
    r"…",  # a placeholder in the doc
]


def pattern_of(line: str) -> re.Pattern[str]:
    """The doc's line with its numbers, ids, hashes and times left free."""
    parts = re.split("(" + "|".join(_FREE) + ")", " ".join(line.split()))
    out = []
    for i, part in enumerate(parts):
        if part is None:
            continue
        if i % 2 == 0 or not any(re.fullmatch(p, part) for p in _FREE):
            out.append(re.escape(part))
        else:
            out.append(r"\S*")
    return re.compile("".join(out))


def _cells(line: str, bar: str) -> list[str]:
    return [c.strip() for c in line.strip().strip(bar).split(bar)]


def _json_fields(value: Any, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        fields = set()
        for key, inner in value.items():
            fields.add(prefix + key)
            fields |= _json_fields(inner, f"{prefix}{key}.")
        return fields
    if isinstance(value, list):
        return set().union(*(_json_fields(v, f"{prefix}[].") for v in value))
    return set()


def _json_of(lines: list[str]) -> Any | None:
    text = "\n".join(lines).strip()
    if not text.startswith("{"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _row_name(line: str, any_zone: bool) -> str:
    name = _cells(line, "│")[0]
    return re.sub(r"zone-[a-z]\b", "zone-?", name) if any_zone else name


def shape_problems(shown: tuple[str, ...], printed: str, *, any_zone: bool = False) -> list[str]:
    """What the doc's output shows that the real output lacks (numbers left free)."""
    doc_json = _json_of(list(shown))
    if doc_json is not None:
        real = _json_of(printed.splitlines())
        if real is None:
            return [f"the doc shows JSON, the command printed: {printed[:300]!r}"]
        want, got = _json_fields(doc_json), _json_fields(real)
        return [
            f"JSON fields differ: doc only {sorted(want - got)}, real only {sorted(got - want)}"
        ] * (want != got)
    real_lines = printed.splitlines()
    headers = [_cells(x, "┃") for x in real_lines if "┃" in x]
    first_cells = {_row_name(x, any_zone) for x in real_lines if x.strip().startswith("│")}
    text = " ".join(" ".join(x.split()) for x in real_lines if not (set(x) & set("┃│")))
    problems = []
    for line in shown:
        if not line.strip() or _is_border(line):
            continue
        if "┃" in line:
            if _cells(line, "┃") not in headers:
                problems.append(f"no table with the columns {_cells(line, '┃')}")
        elif line.strip().startswith("│"):
            name = _row_name(line, any_zone)
            if name and not re.fullmatch(r"[\d.,%-]+", name) and name not in first_cells:
                problems.append(f"no table row for {name!r} (rows: {sorted(first_cells)})")
        elif not pattern_of(line).search(text):
            problems.append(f"no line like {line.strip()!r}")
    return problems


# --- running them --------------------------------------------------------------------------


@dataclass
class Mesh:
    """The mesh the module runs examples against, and what earlier runs printed."""

    work: Path  # the examples' working folder (wine-out/ lives here)
    state: Path
    up_output: str = ""
    printed: dict[str, subprocess.CompletedProcess[str]] = field(default_factory=dict)

    def endpoints(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.state / "endpoints.json").read_text())
        return data

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "SERVEMESH_STATE_DIR": str(self.state),
            "PYTHONPATH": str(REPO),
            "COLUMNS": "250",
        }


def grpcurl() -> str | None:
    return shutil.which("grpcurl", path=f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}")


def argv_of(command: str, mesh: Mesh) -> list[str]:
    """The doc's command, as this machine runs it against this module's mesh."""
    tls = mesh.state / "tls"
    text = command.replace("$ca", str(tls / "trust.pem")).replace(
        "$op", str(tls / "operator" / "current")
    )
    argv = shlex.split(text)
    program = Path(argv[0]).name
    if program == "servemesh":
        return [sys.executable, "-m", "servemesh", *argv[1:]]
    assert program == "grpcurl"
    endpoints = mesh.endpoints()
    addresses: dict[str, str] = endpoints["services"]
    out = [grpcurl() or "grpcurl"]
    for i, arg in enumerate(argv[1:], start=1):
        if arg == "localhost:8080":
            arg = endpoints["edge"]
        elif re.fullmatch(r"127\.0\.0\.1:\d+", arg) and "-servername" in argv:
            instance = argv[argv.index("-servername") + 1].split(".")[0]
            arg = addresses[instance]
        out.append(arg)
        del i
    return out


@dataclass(frozen=True)
class Run:
    """One command run on the mesh, checked against every doc example that shows it
    (`when`: only those whose output holds it, for a command shown in two states)."""

    command: str
    rc: int = 0
    when: str | None = None
    unless: str | None = None
    # Table rows named in either zone count (a traced call goes through one of them).
    any_zone: bool = False
    # Rewrites the argv before it runs (e.g. a request id printed by an earlier run).
    rewrite: Callable[[list[str], Mesh], list[str]] | None = None
    # Polls until the command exits with `rc` and prints what every doc example of it shows
    # (a trace is stored about a second after its answer, and each service exports its own
    # spans: a trace found early may still lack some), for at most POLL_S; then the test
    # compares what the last try printed.
    poll: bool = False

    def matches(self, example: Example) -> bool:
        shown = "\n".join(example.output)
        return (
            self.command == example.command
            and (self.when is None or self.when in shown)
            and (self.unless is None or self.unless not in shown)
        )


def _last_request_id(argv: list[str], mesh: Mesh) -> list[str]:
    traced = mesh.printed["trace"].stdout
    found = re.search(r"request id: (\S+)", traced)
    assert found, traced
    return [*argv[:-1], found[1]]


UP = "servemesh up"
WINE_PUSH = (
    "servemesh models push wine-out/wine.pt2 --model wine --version v1 --metric accuracy=1.0"
)
WINE_LOAD = (
    "servemesh features load wine-out/lots.parquet --view lot --key lot_id --timestamp event_ts"
)
WINE_PREDICT = "servemesh predict --model wine --entity lot=L-0060 --input tasting=3.27,1.25,1.67"
WINE_GRPCURL = (
    '.venv/bin/grpcurl -cacert $ca -d \'{"model": "wine", '
    '"entities": [{"ids": {"lot": "L-0060"}}], '
    '"inputs": {"tasting": {"datatype": "FP32", "shape": [1, 3], "float_values": [3.27, 1.25, 1.67]}}}\''
    " localhost:8080 servemesh.gateway.v1.Gateway/Predict"
)

# In order: each builds on the ones before it (the wine walkthrough: push, alias, a refused
# load, apply, load, predict).
RUNS: list[Run] = [
    Run(
        UP, when="servemesh is up"
    ),  # the module's mesh itself: its output is `servemesh up`'s table
    Run(".venv/bin/servemesh predict --model fraud --entity user-42"),
    Run("servemesh predict --model fraud --entity user-42"),
    Run(".venv/bin/servemesh predict --model fraud --entity user-42 --trace"),
    Run(
        ".venv/bin/servemesh trace be0bf02d-51ec-9f76-9f9f-b8532fc8a03e",
        rewrite=_last_request_id,
        poll=True,
        any_zone=True,
    ),
    Run(".venv/bin/grpcurl -cacert $ca localhost:8080 list"),
    Run(".venv/bin/grpcurl -cacert $ca localhost:8080 describe servemesh.gateway.v1.Gateway"),
    Run(
        '.venv/bin/grpcurl -cacert $ca -d \'{"model": "fraud", "entity_ids": ["user-42"]}\''
        " localhost:8080 servemesh.gateway.v1.Gateway/Predict"
    ),
    Run(".venv/bin/grpcurl -cacert $ca localhost:8080 grpc.health.v1.Health/Check"),
    Run(
        ".venv/bin/grpcurl -cacert $ca -cert $op/cert.pem -key $op/key.pem"
        " -servername model-fraud-zone-a-0.servemesh.internal 127.0.0.1:50052 list"
    ),
    Run("servemesh predict --model fraud --entity user-1 --trace"),
    Run(
        "servemesh trace 0d155fcb-419f-9325-93fd-454a7e905d61",
        rewrite=_last_request_id,
        poll=True,
        any_zone=True,
    ),
    Run("servemesh trace --slowest 3 --since 10m"),
    Run("servemesh trace --hops 30 --since 5m", any_zone=True),
    Run("servemesh models alias fraud production v1"),
    Run("servemesh routes show"),
    Run(".venv/bin/servemesh chaos list"),
    Run("servemesh chaos list"),
    Run(WINE_PUSH),
    Run("servemesh models alias wine production v1"),
    Run("servemesh models show wine production"),
    Run(WINE_LOAD, rc=1, when="not loaded"),
    Run("servemesh apply wine-out/mesh.yaml"),
    Run("servemesh apply wine-out/mesh.yaml --dry-run"),
    Run(WINE_LOAD),
    Run(f"{WINE_PREDICT} --json"),
    Run(WINE_PREDICT),
    Run(WINE_GRPCURL),
    Run("servemesh models list", unless="churn"),
    Run("servemesh routes set fraud v1=90 v2=10"),
]

_WALK = "tests/examples/test_wine_walkthrough.py"
_OFFLINE = "needs no mesh"
_NOT_DEMO = "a mesh of another spec"

# Every example that does not run here, with why (and the test that covers it, if any).
NOT_RUN: dict[str, str] = {
    'README.md: .venv/bin/grpcurl -cacert $ca -H "authorization: Bearer $token" -d \'{"model": "fraud", "entity_ids": ["user-42"]}\' localhost:8080 servemesh.gateway.v1.Gateway/Predict': (
        f"{_NOT_DEMO} (traffic.edge_auth.mode: jwt); tests/mesh/test_edge_auth.py"
    ),
    "README.md: .venv/bin/servemesh top --once": (
        "its rates need tens of seconds of load under Prometheus's 30 s window; "
        "tests/metrics/test_mesh_metrics.py runs top on a loaded mesh"
    ),
    "README.md: .venv/bin/servemesh chaos run zone-outage --var baseline_s=4 --var fault_s=4 --var recover_s=5 --var slo_window_s=3 --var tail_s=1": (
        "a drill starts a mesh of its own and runs timed load phases; tests/chaos"
    ),
    "examples/wine/README.md: servemesh models push cut.pt2 --model wine --version v2": (
        f"a damaged archive refused; {_WALK}::test_bad_models_are_refused_and_leave_nothing_behind"
    ),
    "examples/wine/README.md: servemesh models push wine-out/wine.pt2 --model wine --version v2 --signature wrong.yaml": (
        f"a wrong signature refused; {_WALK}::test_bad_models_are_refused_and_leave_nothing_behind"
    ),
    "examples/wine/README.md: servemesh features load bad_lots.parquet --view lot --key lot_id --timestamp event_ts": (
        f"a bad row refused; {_WALK}::test_a_feature_file_with_text_in_a_number_column_loads_nothing"
    ),
}


def _listed(doc: str, reason: str, *commands: str) -> None:
    for command in commands:
        NOT_RUN[f"{doc}: {command}"] = reason


_listed(
    "docs/runbooks/README.md",
    "a drill starts a mesh of its own and runs timed load phases; tests/chaos",
    "servemesh chaos run zone-outage",
    "servemesh chaos run zone-outage --var fault_s=10 --var rate=50",
    "servemesh chaos run chaos/experiments/bad-canary.yaml --spec my-mesh.yaml --out /tmp/canary",
    "servemesh chaos run zone-outage --var recover_early=true",
)


_listed(
    "docs/models.md",
    f"a damaged or refused artifact; {_WALK} and tests/model/test_push_checks.py",
    "servemesh models push cut.pt2 --model wine --version v2",
    "servemesh models push wine-out/wine.pt2 --model wine --version v2 --signature wrong.yaml",
    "servemesh features load bad_lots.parquet --view lot --key lot_id --timestamp event_ts",
)


for _doc, _flag in (("examples/wine/README.md", ""), ("docs/models.md", " --prune")):
    _listed(
        _doc,
        "needs a second wine version pushed; the refusal is tested in "
        "tests/unit/test_live_apply_plan.py and tests/mesh/test_live_apply.py",
        f"servemesh apply mesh-v2-only.yaml{_flag}",
    )
_listed(
    "docs/operators.md",
    "needs a mesh with an SLO and a version failing on purpose, or a feature drifting for "
    "15 minutes; tests/rollout/test_gates_mesh.py runs it (the fast burn paged, listed and "
    "resolved), tests/metrics/test_drift_rules.py fires the drift alert",
    "servemesh alerts",
)
_listed(
    "docs/rollouts-gates.md",
    "needs a mesh inside a freeze window; tests/rollout/test_rollout_mesh.py runs it frozen",
    "servemesh routes set fraud v1=80 v2=20",
)
_listed("docs/models.md", "the churn walk-through's registry", "servemesh models list")
_listed(
    "docs/models.md",
    "the tree models' walk-through (trained, pushed, applied and called on a mesh of its own); "
    f"{_WALK}::test_tree_models_push_as_onnx_and_a_zipmap_output_is_refused and "
    "::test_tree_models_answer_what_their_libraries_answer, tests/model/test_onnx_models.py",
    "servemesh models push trees-out/forest.onnx --model wine-forest --version v1 --metric accuracy=1.0",
    "servemesh models push trees-out/gbm.onnx --model wine-gbm --version v1",
    "servemesh apply trees-out/mesh.yaml",
    "servemesh predict --model wine-gbm --input measurements=14.23,1.71,2.43,15.6,127,2.8,3.06,0.28,2.29,5.64,1.04,3.92,1065 --input measurements=12.33,1.1,2.28,16,101,2.05,1.09,0.63,0.41,3.27,1.25,1.67,680",
    "servemesh models push zipmap.onnx --model wine-forest --version v2",
    "servemesh models push custom-op.onnx --model wine-forest --version v2",
)
_listed(
    "docs/capacity.md",
    "a default mesh overloaded past its host (40 s of load at 600 and 250 req/s); "
    "tests/scaling/test_edge_scaling.py, tests/unit/test_scaling_edge.py",
    "servemesh scale status",
    "servemesh scale history",
)
_listed(
    "docs/features.md",
    "a customers file and a view of another spec; tests/feature/test_load_cli.py",
    ".venv/bin/servemesh features load customers.parquet --view customer --key customer_id --timestamp event_ts",
    ".venv/bin/servemesh features load messy.csv --view customer --key customer_id",
)
_listed(
    "docs/features.md",
    "a feature server in plaintext (tls off); tests/feature/test_packed.py, tests/feature/test_wire.py",
    'grpcurl -plaintext -d \'{"view": "user", "entity_ids": ["user-1"], "feature_names": ["f00", "f01"]}\' 127.0.0.1:40123 servemesh.feature.v1.FeatureService/GetFeatures',
    'grpcurl -plaintext -d \'{"view": "user", "entity_ids": ["user-1"], "feature_names": ["f00", "f01"], "packed": true}\' 127.0.0.1:40123 servemesh.feature.v1.FeatureService/GetFeatures',
)
_listed(
    "docs/models.md",
    "a model of two entities (lot, seller) that no example ships; tests/mesh/test_named_outputs.py",
    "servemesh predict --model wine --entity lot=L-3,seller=m-2 --entity lot=L-1,seller=m-1 --input tasting=1,0,-1 --input tasting=0.5,2,0",
    "servemesh predict --model wine --entity lot=L-3,seller=m-2 --input tasting=1,0,-1 --json",
    'grpcurl -plaintext -d \'{"model": "wine", "entities": [{"ids": {"lot": "L-3", "seller": "m-2"}}, {"ids": {"lot": "L-1", "seller": "m-1"}}], "inputs": {"tasting": {"shape": [2, 3], "float_values": [1, 0, -1, 0.5, 2, 0]}}}\' localhost:8080 servemesh.gateway.v1.Gateway/Predict',
)
_listed(
    "docs/models.md",
    "a `churn` model built by hand (and hostile or damaged files); tests/registry/test_models_cli.py, "
    "tests/mesh/test_models_cli.py, tests/model/test_torchscript_guard.py",
    "servemesh models push churn.pt2 --model churn --version v1 --signature sig.yaml --label team=growth --lineage data=sha256:5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e --lineage code=9ce8f64 --metric auc=0.91",
    "servemesh models push churn.pt --model churn --version v2",
    "servemesh models push churn.pt --model churn --version v2 --signature wrong.yaml",
    "servemesh models push churn.pt2 --model churn --version v2 --signature wrong.yaml",
    "servemesh models push notes.csv --model churn --version v2",
    "servemesh models push cut.pt2 --model churn --version v2",
    "servemesh models push hostile.pt2 --model churn --version v2",
    "servemesh models push churn.pt2 --model churn --version v2 --lineage data=md5:abc",
    "servemesh models push reader.pt --model churn --version v3 --signature sig.yaml",
    "servemesh models alias churn production v1",
    "servemesh models show churn production",
)
_listed(
    "docs/models.md",
    "a model server in plaintext, called directly; tests/model/test_model_multi_tensor.py",
    'grpcurl -plaintext -d \'{"model_name": "churn", "inputs": [{"name": "features", "datatype": "FP32", "shape": [2, 4], "contents": {"fp32_contents": [0.1, 0.2, 0.3, 0.4, -1, 0, 1, 2]}}, {"name": "category", "datatype": "INT64", "shape": [2], "contents": {"int64_contents": [2, 4]}}]}\' 127.0.0.1:48575 inference.GRPCInferenceService/ModelInfer',
    'grpcurl ... (the same with "datatype": "INT32" and int_contents for category)',
)
_listed(
    "docs/models.md",
    "quantizing and exporting run for tens of seconds each; tests/model/test_quantize.py, tests/edge/test_export.py",
    "servemesh models quantize fraud v1 --to int8",
    "servemesh models quantize churn v1 --to fp16 --reference rows.npz --max-abs-error 0",
    "servemesh models quantize churn v1 --to int8",
    "servemesh models export fraud v1 --format onnx --out fraud.onnx",
)
_listed(
    "docs/serving-patterns.md",
    "exporting runs for tens of seconds; tests/edge/test_export.py",
    "servemesh models export fraud v1 --format onnx --out fraud.onnx",
)
for _doc in ("docs/models.md", "docs/serving-patterns.md"):
    _listed(
        _doc,
        "writes under /opt and needs an exported model; tests/edge/test_sync.py",
        "servemesh edge sync --model fraud --alias production --dir /opt/models",
    )
_listed(
    "docs/multihost.md",
    "hosts of their own (Docker Compose, a control plane of several hosts); "
    "tests/discovery/test_compose_file.py, tests/discovery/test_control_plane.py",
    "servemesh compose init",
    "servemesh control-plane --spec resolved.yaml --ready-file ready",
)
_listed(
    "docs/multihost.md",
    "needs the compose mesh up (Docker Engine, docker-compose, the images); "
    "tests/containers/test_compose_mesh.py runs it",
    "servemesh predict --model fraud --entity user-42 --address 127.0.0.1:8443 --spec deploy/compose/mesh-dns.yaml --state-dir deploy/compose/rendered-dns/state",
)
_listed(
    "docs/operators.md",
    "a walk-through that deletes the store's keys between its steps; "
    "tests/feature/test_store_backup.py runs backup and restore against a real Redis",
    "servemesh features backup --out /tmp/fsbk/bk1",
    "servemesh features restore /tmp/fsbk/bk1",
)
_listed(
    "docs/operators.md",
    "a walk-through that deletes keys, log files and moves weights between its steps; "
    "tests/mesh/test_mesh_backup.py runs backup and restore on a real mesh",
    "servemesh backup --out /tmp/bkdemo/bk1",
    "servemesh restore /tmp/bkdemo/bk2",
    "servemesh restore /tmp/bkdemo/bk1",
)
_listed(
    "docs/multihost.md",
    "needs the compose mesh (or the Swarm stack) up on the local images; "
    "tests/containers/test_compose_mesh.py and test_swarm_stack.py run them",
    "servemesh routes set fraud v1=50 v2=50 --state-dir deploy/compose/rendered-dns/state",
    "servemesh apply /tmp/cb.yaml --state-dir deploy/compose/rendered-dns/state",
    "servemesh routes show --state-dir deploy/compose/rendered-dns/state",
    "servemesh predict --model fraud --entity user-42 --address 127.0.0.1:18443 --spec deploy/compose/mesh-dns.yaml --state-dir deploy/compose/rendered-dns/state --trace",
    "servemesh trace 4feb0259-d85a-4e96-8b26-188f63e2a1c4 --state-dir deploy/compose/rendered-dns/state",
)
_listed(
    "docs/multihost.md",
    "starts a compose project of its own (Docker Engine, docker-compose, the images); "
    "tests/containers/test_container_drills.py runs it",
    "servemesh chaos run containers-zone-proxy-crash --out /tmp/drill1 --var recover_early=true",
)
_listed(
    "docs/benchmarks.md",
    "DRILL stands for each drill of the table, a run of minutes each; tests/chaos/ and "
    "tests/containers/test_container_drills.py run them shortened",
    "servemesh chaos run DRILL --var rate=50 --var baseline_s=5 --var fault_s=10 --var recover_s=20 --var recover_early=true --var slo_window_s=3 --var tail_s=0.5",
)
_listed(
    "docs/benchmarks.md",
    "nine meshes one after another, about ten minutes; tests/unit/test_layout_bench.py checks the arms",
    "servemesh bench layout --arms per_zone replicated one-edge --repeats 3",
    "servemesh bench layout --arms per_zone replicated --repeats 5 --duration 6s",
)
_listed(
    "docs/observability.md",
    "its rates need tens of seconds of load under Prometheus's window; tests/metrics/test_mesh_metrics.py",
    "servemesh top --once --source prometheus --window 30",
)
_listed(
    "docs/observability.md",
    "a prediction log in PostgreSQL with a day of records; tests/predlog/test_log_command.py",
    "servemesh log query --state-dir state --since 1d --slowest 1%",
    "servemesh log query --state-dir state --since 1h --entity user=user-17",
    "servemesh log query --state-dir state --since 5m --errors",
    "servemesh log query --state-dir state --json --request-id 3d0a72c9-14be-4607-b2c8-b987ebf239ce",
    "servemesh log status --state-dir state",
)
_listed(
    "docs/operators.md",
    "files of the doc's own walk-through (a `risk` model, tiers); tests/mesh/test_live_apply.py, "
    "tests/mesh/test_tiers.py",
    "servemesh apply mesh.yaml",
    "servemesh apply tiers.yaml --dry-run",
)
_listed(
    "docs/operators.md",
    "a quarantined version needs a model server crashed on it; tests/mesh/test_quarantine.py",
    "servemesh models show risk",
    "servemesh models show risk v2",
    "servemesh models release risk v2",
    "servemesh routes set risk v1=90 v2=10",
)
_listed(
    "docs/operators.md",
    "a second `up` on a running mesh's state dir; tests/mesh/test_up_command.py",
    "servemesh up",
)
_listed(
    "docs/operators.md",
    "a mesh whose fraud logs its features, with a reference file and shifted traffic; "
    "tests/mesh/test_drift.py runs it, tests/predlog/test_drift_command.py every flag",
    "servemesh drift fraud --state-dir state --set-reference train.parquet",
    "servemesh drift fraud --state-dir state",
    "servemesh drift fraud --state-dir state --show-reference",
)
_listed(
    "docs/registry.md",
    "usage lines, not commands (placeholders in brackets); tests/registry/test_backup.py",
    "servemesh registry backup [--out DIR] [--keep N]",
    "servemesh registry restore BACKUP_DIR [--snapshot NAME]",
)
_listed(
    "docs/rollouts-fleet.md",
    "a fleet of meshes; tests/rollout/test_fleet.py, tests/rollout/test_fleet_up.py",
    "servemesh fleet retire",
)
_listed(
    "docs/rollouts.md",
    "a rollout judges minutes of traffic; tests/rollout/test_rollout_mesh.py, tests/rollout/test_rollout_cli.py",
    "servemesh rollout start fraud v3 --plan plan.yaml",
    "servemesh rollout start fraud v2 --plan plan.yaml",
    "servemesh rollout start fraud v4 --plan plan.yaml",
    "servemesh rollout start fraud v5 --plan plan.yaml",
    "servemesh rollout status fraud",
)
_listed(
    "docs/security.md",
    "a replica's plaintext admin port, an attacker's view; tests/mesh/test_control_auth.py",
    '.venv/bin/grpcurl -plaintext -H "$auth" -d \'{"model_name": "fraud", "parameters": {"version": {"string_param": "v2"}}}\' <replica address> inference.GRPCInferenceService/RepositoryModelLoad',
)
_listed(
    "docs/serving-patterns.md",
    "batch scoring of the whole view, with a job history; tests/batch/test_score.py",
    "servemesh batch score --model fraud --out fraud-scores.parquet",
    "servemesh batch score --model fraud --alias production --out redis",
    "servemesh batch history",
)
_listed(
    "docs/serving-patterns.md",
    "a benchmark of repeated timed rounds; tests/streams/test_mesh_streams.py",
    "servemesh bench stream --rate 500 --duration 5s --repeats 3",
)
_listed(
    "docs/tiers.md",
    "a tiers file of the doc's own; tests/mesh/test_tiers.py",
    "servemesh apply tiers.yaml",
)


# --- the module's mesh ---------------------------------------------------------------------


def _train(work: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "examples.wine.train", "--out", "wine-out"],
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _run(run: Run, mesh: Mesh) -> subprocess.CompletedProcess[str]:
    argv = argv_of(run.command, mesh)
    if run.rewrite is not None:
        argv = run.rewrite(argv, mesh)

    def once() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, cwd=mesh.work, env=mesh.env(), capture_output=True, text=True, timeout=120
        )

    if not run.poll:
        return once()
    shown = [e.output for e in EXAMPLES if run.matches(e)]

    def whole() -> subprocess.CompletedProcess[str] | None:
        done = once()
        printed = done.stdout + done.stderr
        lacks = any(shape_problems(o, printed, any_zone=run.any_zone) for o in shown)
        return done if done.returncode == run.rc and not lacks else None

    try:
        return wait_until(whole, f"{run.command} to print what its examples show", timeout_s=POLL_S)
    except pytest.fail.Exception:
        return once()  # its examples' tests say what this lacks


@pytest.fixture(scope="module")
def ran(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[int, subprocess.CompletedProcess[str]]]:
    """The mesh started with `servemesh up`, every run of RUNS in order, the mesh stopped."""
    work = tmp_path_factory.mktemp("docs")
    state = work / ".servemesh"
    # The doc's default state dir, relative to the examples' folder, as a reader's.
    spec = MeshSpec(ports=Ports.free(), state_dir=".servemesh")
    (work / "mesh.yaml").write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    mesh = Mesh(work, state)
    results: dict[int, subprocess.CompletedProcess[str]] = {}
    up_log = work / "logs" / "up.log"

    def up_printed_its_table() -> bool:
        return up_log.exists() and "Ctrl-C stops the mesh" in up_log.read_text()

    training = _train(work)  # side by side with the mesh's start
    try:
        with Supervisor(work / "logs", cwd=work) as supervisor:
            argv = [sys.executable, "-m", "servemesh", "up", "--spec", "mesh.yaml"]
            ready = Check(up_printed_its_table, "up's endpoint table")
            supervisor.start("up", argv, ready=ready, timeout_s=180)
            _, err = training.communicate(timeout=120)
            assert training.returncode == 0, err
            for index, run in enumerate(RUNS):
                if run.command == UP:
                    # As a reader's shell shows it: paths from the folder, the program by its name.
                    text = up_log.read_text().replace(f"{work}/", "")
                    text = text.replace(f"{REPO}/servemesh/__main__.py", "servemesh")
                    results[index] = subprocess.CompletedProcess(["up"], 0, text, "")
                elif Path(shlex.split(run.command)[0]).name != "grpcurl" or grpcurl() is not None:
                    try:
                        results[index] = _run(run, mesh)
                    except Exception as e:  # one broken run fails its examples, not all
                        results[index] = subprocess.CompletedProcess([], -1, "", repr(e))
                    if run.command.endswith("--trace"):
                        mesh.printed["trace"] = results[index]
            yield results
            pids = mesh.endpoints()["pids"]
            assert supervisor.stop("up", grace_s=60) == 0
    finally:
        if training.poll() is None:
            training.kill()
        training.communicate()
    assert [name for name, pid in pids.items() if _pid_alive(pid)] == []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- the tests -----------------------------------------------------------------------------

EXAMPLES = all_examples()


def _run_of(example: Example) -> int | None:
    return next((i for i, run in enumerate(RUNS) if run.matches(example)), None)


def test_every_example_is_run_or_listed() -> None:
    unclassified = [
        f"{e.doc}:{e.line}: {e.command}"
        for e in EXAMPLES
        if _run_of(e) is None and e.key not in NOT_RUN
    ]
    assert unclassified == [], (
        "console examples neither run by RUNS nor listed in NOT_RUN with a reason "
        f"({__name__}):\n" + "\n".join(unclassified)
    )
    keys = {e.key for e in EXAMPLES}
    assert sorted(set(NOT_RUN) - keys) == [], "NOT_RUN lists examples no doc holds any more"
    unused = [r.command for i, r in enumerate(RUNS) if not any(_run_of(e) == i for e in EXAMPLES)]
    assert unused == [], "RUNS runs commands no doc shows any more"


def test_the_extraction_finds_the_examples() -> None:
    # A parser that found nothing would make every other test here pass.
    by_doc = {e.doc for e in EXAMPLES}
    assert {"README.md", "examples/wine/README.md", "docs/models.md"} <= by_doc
    assert sum(e.program == "grpcurl" for e in EXAMPLES) >= 5
    assert len([e for e in EXAMPLES if _run_of(e) is not None]) >= 25


def _request_json_problems(argv: list[str]) -> list[str]:
    """Without grpcurl: the request's JSON parsed into the method's request message."""
    if "-d" not in argv:
        return []
    body = argv[argv.index("-d") + 1]
    service, method = argv[-1].rsplit("/", 1)
    import servemesh_api.gateway.v1.gateway_pb2  # noqa: F401, PLC0415 (registers the descriptors)

    pool = symbol_database.Default().pool
    descriptor = pool.FindServiceByName(service).FindMethodByName(method).input_type
    message = symbol_database.Default().GetPrototype(descriptor)()
    try:
        json_format.Parse(body, message)
    except json_format.ParseError as e:
        return [f"request JSON does not fit {descriptor.full_name}: {e}"]
    return []


RUN_EXAMPLES = [e for e in EXAMPLES if _run_of(e) is not None]


# The examples run on a mesh of their own (`servemesh up` in a child process): the mesh lane.
@pytest.mark.mesh
@pytest.mark.parametrize("example", RUN_EXAMPLES, ids=[f"{e.doc}:{e.line}" for e in RUN_EXAMPLES])
def test_example_runs_as_the_doc_shows(
    example: Example, ran: dict[int, subprocess.CompletedProcess[str]]
) -> None:
    index = _run_of(example)
    assert index is not None
    run = RUNS[index]
    if index not in ran:  # grpcurl is not installed
        problems = _request_json_problems(shlex.split(example.command))
        warnings.warn(
            f"{example.doc}:{example.line}: grpcurl is not installed; only the request JSON "
            "was checked against the proto",
            stacklevel=1,
        )
        assert problems == []
        return
    done = ran[index]
    assert done.returncode == run.rc, (
        f"exit {done.returncode}, not {run.rc}:\n{done.stdout}\n{done.stderr}"
    )
    problems = shape_problems(example.output, done.stdout + done.stderr, any_zone=run.any_zone)
    assert problems == [], (
        f"{example.doc}:{example.line} `{example.command}` printed:\n"
        f"{done.stdout}{done.stderr}\nwhat the doc shows and this lacks:\n" + "\n".join(problems)
    )
