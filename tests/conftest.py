"""Fixtures shared by every test: real processes on loopback, stopped by PID."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

from servemesh import launcher
from servemesh.procs import RedisServer, Supervisor, prometheus
from servemesh.proxy import process
from tests.postgres_server import PostgresServer

# The tests that start Envoy (a whole mesh, or Envoy alone), by path under tests/. Every
# test here is marked `mesh`; `make test-fast` runs the rest (`-m "not mesh"`), where a
# test that starts Envoy all the same fails with a pointer here (pytest_configure), so the
# list cannot fall behind the tests.
MESH_PATHS = (
    "mesh/",
    "capacity/test_capacity_plan_cli.py",
    "chaos/test_drills.py",
    "chaos/test_partition.py",
    "chaos/test_registry_drill.py",
    "chaos/test_stream_drill.py",
    "chaos/test_zone_and_replica_drills.py",
    "chaos/test_zone_proxy_drill.py",
    "discovery/test_control_plane.py",
    "examples/test_wine_walkthrough.py",
    "fuzz/test_campaign.py",
    "fuzz/test_command.py",
    "metrics/",
    "netns/test_sandboxed_models.py",
    "netns/test_sigterm.py",
    "netns/test_zone_envoys.py",
    "registry/test_models_cli.py",
    "rollout/test_budget_promql.py",
    "rollout/test_fleet.py",
    "rollout/test_fleet_up.py",
    "rollout/test_gates_mesh.py",
    "rollout/test_rollout_drills.py",
    "rollout/test_rollout_mesh.py",
    "rollout/test_sticky.py",
    "scaling/test_edge_scaling.py",
    "scaling/test_mesh_scaling.py",
    "streams/test_mesh_streams.py",
    "tracing/test_mesh_traces.py",
)
# Tests that start no Envoy but run whole commands or clusters for seconds each (the batch
# command in child processes, a Dask cluster), or a sandboxed child that imports
# torch.export (and, to export, the ONNX stack) for each test: 5 to 19 s a test, half the
# no-mesh lane's time between them. Marked `slow`, left out of the fast lane (`make
# test-fast` runs `-m "not mesh and not slow"`), run by `make test`.
# A single test of that kind in a quick module carries `@pytest.mark.slow` itself.
SLOW_PATHS = (
    "batch/test_dask_engine.py",
    "batch/test_outputs.py",
    "batch/test_resume.py",
    "batch/test_schedule.py",
    "model/test_quantize.py",
    "model/test_model_bench.py",
    "edge/test_export.py",
    "edge/test_sync.py",
)
# `make test` runs the suite on three workers (pytest-xdist, `--dist loadgroup`): each test is
# in a group that runs whole on one worker, in collection order. A module is its own group,
# so its module-scoped fixtures (its mesh) start once; the modules on a package's shared mesh
# are one group; and tests that make network namespaces are one group, so they never run side
# by side (each picks its subnet at random from one range, and cleans up what it made).
PACKAGE_MESHES = ("metrics/", "fuzz/", "tracing/")
# Tests that build and start the images (`make images`): marked `containers`, run by `make
# test` after the others (on their own) and by `make test-containers`, and skipped where no
# Docker engine answers.
CONTAINER_PATHS = ("containers/",)
# The tests whose meshes run Prometheus where its binary is installed (the launcher's
# `metrics.prometheus: auto`): the ones that read it (the metrics tests, rollout gates and
# analysis, the bad-canary drill's controller). Every other mesh a test starts in its own
# process runs as on a machine without the binary, the services' /metrics alone: a
# Prometheus scraping every mesh cost about 1 s of CPU at each start and a fifth of an idle
# mesh's CPU (docs/testing.md, 2026-12-05 late), for tests that never asked it anything. A test
# outside these paths that skips for want of Prometheus while it is installed fails instead
# (pytest_runtest_makereport), so this list cannot hide a test. Meshes started by
# `servemesh up` in a child process keep the default.
PROMETHEUS_PATHS = ("metrics/", "rollout/", "chaos/test_drills.py")
NETNS_PATHS = ("netns/", "chaos/test_partition.py", "mesh/test_up_command.py")
_TESTS = Path(__file__).parent


def _under(path: Path, prefixes: tuple[str, ...]) -> bool:
    relative = path.relative_to(_TESTS).as_posix()
    return any(relative.startswith(prefix) for prefix in prefixes)


def _starts_envoy(path: Path) -> bool:
    return _under(path, MESH_PATHS)


def worker_group(item: pytest.Item, on_mesh_package: set[Path]) -> str:
    """The group a test runs in under `--dist loadgroup` (see PACKAGE_MESHES)."""
    relative = item.path.relative_to(_TESTS).as_posix()
    if _under(item.path, NETNS_PATHS):
        return "netns"
    for package in PACKAGE_MESHES:
        if relative.startswith(package):
            return package
    if item.path in on_mesh_package:
        return "mesh/ (shared mesh)"
    return relative


def path_marks(path: Path) -> set[str]:
    """The marks every test of a module gets from where it lies (pytest_collection_modifyitems)."""
    marks = set()
    if _starts_envoy(path):
        marks.add("mesh")
    if _under(path, SLOW_PATHS):
        marks.add("slow")
    if _under(path, CONTAINER_PATHS):
        marks.add("containers")
    return marks


def excluded_marks(markexpr: str) -> set[str] | None:
    """The marks a `-m` of the form "not a and not b ..." excludes; None for any other form
    (one whose answer a module's own marks cannot settle)."""
    terms = [t.split() for t in markexpr.split(" and ")] if markexpr.strip() else []
    if not terms or any(len(t) != 2 or t[0] != "not" for t in terms):
        return None
    return {t[1] for t in terms}


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A module every test of which `-m` deselects by where it lies is not imported at all:
    the fast lane (`-m "not mesh and not slow and not containers"`) would otherwise import
    every mesh and slow module on every worker, for nothing (a Dask cluster's imports alone
    take a second and a half)."""
    excluded = excluded_marks(str(config.getoption("markexpr") or ""))
    if not excluded or collection_path.suffix != ".py" or _TESTS not in collection_path.parents:
        return None
    return True if path_marks(collection_path) & excluded else None


# First: pytest-xdist's worker reads the groups in its own pass over the items.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    from tests.mesh.conftest import on_package_mesh

    # A module of tests/mesh with any test on the package's mesh runs beside the others on it.
    on_mesh_package = {item.path for item in items if on_package_mesh(item)}
    for item in items:
        for mark in sorted(path_marks(item.path)):
            item.add_marker(getattr(pytest.mark, mark))
        item.add_marker(pytest.mark.xdist_group(worker_group(item, on_mesh_package)))


# Each Envoy holds an inotify instance per watched xDS or SDS file (a mesh's three about 45),
# and the kernel counts them per user: at its common default of 128, three workers' meshes
# abort the next Envoy at start (`assert failure: inotify_fd_ >= 0`). `.ci/run` raises it.
INOTIFY_INSTANCES_WANTED = 1024
INOTIFY_LIMIT_FILE = Path("/proc/sys/fs/inotify/max_user_instances")


def pytest_report_header(config: pytest.Config) -> list[str]:
    """A warning before the mesh tests start Envoys, where the inotify limit is too low."""
    try:
        limit = int(INOTIFY_LIMIT_FILE.read_text())
    except (OSError, ValueError):
        return []
    if limit >= INOTIFY_INSTANCES_WANTED:
        return []
    return [
        f"WARNING: fs.inotify.max_user_instances is {limit}: mesh tests side by side may see "
        "Envoy abort at start (inotify_fd_ >= 0). Raise it first: "
        f"sudo sysctl -w fs.inotify.max_user_instances={INOTIFY_INSTANCES_WANTED}"
    ]


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(GroupOrder(), "servemesh-group-order")
    config.pluginmanager.register(PrometheusWhereRead(), "servemesh-prometheus-where-read")
    # pytest-xdist's `--dist loadgroup` hands out groups sorted by their number of tests
    # unless told not to (`--loadscope-reorder`, its default): the one-test drill modules
    # then ran last, each alone for a minute beside idle workers. The groups go in
    # GroupOrder's order instead (the costliest first).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if config.option.markexpr.replace(" ", "").startswith("notmesh"):
        # The fast lane: nothing may start Envoy, session fixtures included. Test modules
        # are imported after this, so their own `from ... import envoy_command` gets it too.
        process.envoy_command = _envoy_refused
        # launcher imports the name without re-exporting it; its copy is replaced as well.
        launcher.envoy_command = _envoy_refused  # type: ignore[attr-defined]


# Tests without Envoy that still take seconds each: each runs model code in sandboxed
# children (an interpreter importing torch, 2-5 s apiece) or a command in a child
# interpreter. Seconds per test, about what `--durations=0` shows on a quiet machine
# (docs/testing.md, 2026-12-05 evening); without them these modules sorted among the
# quick ones and started last.
HEAVY_PATHS = {
    "model/test_quantize.py": 15.0,
    "edge/test_export.py": 15.0,
    "edge/test_sync.py": 7.0,
    "batch/test_score.py": 5.0,
    "model/test_model_bench.py": 4.0,
    "unit/test_demo_artifact.py": 4.0,
    "sandbox/": 3.0,
    "feature/test_load_cli.py": 3.0,
    "unit/test_floor_plan.py": 1.0,
}


def _cost(item: pytest.Item) -> float:
    """A rough guess of a test's seconds, to start the longest groups first."""
    relative = item.path.relative_to(_TESTS).as_posix()
    if "drill" in relative or relative.startswith("chaos/test_partition"):
        return 25.0
    if item.get_closest_marker("mesh") is not None:
        return 4.0
    if item.get_closest_marker("slow") is not None:
        return 10.0
    for prefix, seconds in HEAVY_PATHS.items():
        if relative.startswith(prefix):
            return seconds
    return 0.1


class GroupOrder:
    """Last, after every reordering (tests/mesh/conftest.py's among them): whole groups, the
    costliest first, each in its own order. The scheduler hands groups to the workers in
    this order, so the long ones start at once and the many short ones fill the end of the
    run (longest-processing-time first), rather than one long group running alone at the
    end. (A plugin of its own: a conftest holds one hook implementation per name.)"""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        order_groups(items)


def order_groups(items: list[pytest.Item]) -> None:
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        groups.setdefault(str(mark.args[0]) if mark else item.nodeid, []).append(item)
    cost = {
        name: sum(_cost(i) for i in members)
        + (15.0 if any(i.get_closest_marker("mesh") for i in members) else 0.0)
        for name, members in groups.items()
    }
    ordered = sorted(groups, key=lambda name: -cost[name])
    items[:] = [item for name in ordered for item in groups[name]]


class PrometheusWhereRead:
    """Prometheus for the meshes of PROMETHEUS_PATHS' tests only. The launcher looks for the
    binary when a mesh starts, during the setup of the first test that asks for it, so the
    test being run decides."""

    def __init__(self) -> None:
        self.installed = prometheus.prometheus_binary
        self.current: pytest.Item | None = None
        # launcher imports the name; its copy is the one a mesh's start calls.
        launcher.prometheus_binary = self.binary  # type: ignore[attr-defined]

    def binary(self) -> str | None:
        if self.current is None or not _under(self.current.path, PROMETHEUS_PATHS):
            return None
        return self.installed()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        self.current = item
        try:
            yield
        finally:
            self.current = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item) -> Generator[None, Any, None]:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        if not report.skipped or _under(item.path, PROMETHEUS_PATHS):
            return
        reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else "")
        if "prometheus" in reason.lower() and self.installed() is not None:
            report.outcome = "failed"
            report.longrepr = (
                f"skipped for want of Prometheus, which is installed ({reason}): the meshes "
                "of tests outside PROMETHEUS_PATHS (tests/conftest.py) run without it; add "
                "this test's path there"
            )


def _envoy_refused(*args: object, **kwargs: object) -> list[str]:
    raise AssertionError(
        "this test starts Envoy but its path is not in MESH_PATHS (tests/conftest.py): "
        "add it there, or keep Envoy out of it"
    )


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server of our own on a free loopback port, for the whole session.

    Its URL carries the password (a spec-given external URL may): the tests' clients and
    feature services connect with it as they are."""
    root = tmp_path_factory.mktemp("redis")
    with Supervisor(root / "logs") as supervisor:
        # Keyspace events for the tests that watch a load's keys (CONFIG SET is disabled).
        server = RedisServer(supervisor, root / "data", settings=('notify-keyspace-events "K$g"',))
        server.start(timeout_s=10)
        yield f"redis://:{server.password}@{server.host}:{server.port}/0"


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A real PostgreSQL of our own (initdb in a temp dir, a free loopback port) for the
    whole session, with an empty database `test`; stopped by PID, its files removed."""
    root = Path(tempfile.mkdtemp(prefix="servemesh-postgres-"))
    root.chmod(0o711)  # as root, the cluster runs as `postgres`, who must pass through
    try:
        with Supervisor(root / "logs") as supervisor:
            server = PostgresServer(supervisor, root / "cluster")
            server.start()
            yield server
    finally:
        shutil.rmtree(root, ignore_errors=True)
