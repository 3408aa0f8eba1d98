"""The control plane: watch a catalog, keep Envoy's endpoint files equal to it.

One watcher thread per service kind holds a blocking query open (Consul answers when the
kind's instances or their health change, or after `wait_s`); every change recomputes the
endpoint files and renames those that changed into Envoy's watched folder. Routes and
clusters are the spec's and are left alone. When the catalog cannot be reached the files
stay as they are (Envoy keeps its endpoints, and its own health checks) and the watcher
tries again.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from servemesh.catalog.consul_catalog import ConsulCatalog
from servemesh.catalog.file import Catalog, CatalogEntry, FileCatalog
from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.errors import ServemeshError
from servemesh.discovery.endpoints import endpoint_files, write_endpoint_files
from servemesh.proxy.render import EnvoyResources, render_proxies
from servemesh.spec import ResolvedSpec, ServiceKind, load_resolved
from servemesh.state.paths import MeshPaths, XdsLayout

log = logging.getLogger(__name__)

# How long one blocking query waits for a change before it is asked again.
WAIT_S = 30.0
# After a failed query (the catalog unreachable), before the next.
RETRY_S = 1.0


class NoCatalog(ServemeshError, ValueError):
    """The spec's discovery has no catalog to follow (`discovery.backend: dns`)."""


def catalog_for(spec: ResolvedSpec) -> Catalog:
    """The catalog the spec names: Consul, or the spec's own instances. With
    `discovery.backend: dns` there is none: Envoy resolves the names itself."""
    if spec.discovery.backend == "dns":
        raise NoCatalog(
            "discovery.backend: dns has no catalog and no endpoint files: Envoy resolves "
            "discovery.dns_names itself (STRICT_DNS clusters), so no control plane runs"
        )
    if spec.discovery.backend == "consul":
        return ConsulCatalog(spec)
    return FileCatalog(spec)


class ControlPlane:
    """Writes the endpoint files of `spec`'s clusters from `catalog`, for each of the mesh's
    Envoys under its own watched folder (`paths.xds_of`): the shared layout's one, or in the
    per-zone layout the edge's and each zone's, each with only the clusters it holds."""

    def __init__(
        self,
        spec: ResolvedSpec,
        catalog: Catalog,
        paths: MeshPaths,
        *,
        wait_s: float = WAIT_S,
        retry_s: float = RETRY_S,
    ) -> None:
        self.spec = spec
        self.catalog = catalog
        self.wait_s = wait_s
        self.retry_s = retry_s
        # Only the endpoint sets are used: the log paths in listeners never reach a file.
        logs = Path(spec.state_dir) / "logs"
        self.targets: list[tuple[EnvoyResources, XdsLayout]] = [
            (resources, paths.xds_of(proxy))
            for proxy, resources in render_proxies(spec, logs).items()
        ]
        self.kinds: list[ServiceKind] = sorted(
            {s.kind for resources, _ in self.targets for s in resources.endpoint_sets.values()}
        )
        self._changed = threading.Condition()
        self._seen: dict[ServiceKind, list[CatalogEntry]] = {}
        self._dirty = False
        self._stop = threading.Event()
        # How many times files were written (for status and tests).
        self.rounds = 0

    def sync(self, entries: list[CatalogEntry]) -> list[Path]:
        """Write every Envoy's endpoint files for `entries` now; returns the files that
        changed."""
        written: list[Path] = []
        for resources, layout in self.targets:
            written += write_endpoint_files(endpoint_files(resources, layout, entries))
        return written

    def stop(self) -> None:
        self._stop.set()
        self.catalog.close()
        with self._changed:
            self._changed.notify_all()

    def run(self, on_first_write: Callable[[], None] | None = None) -> None:
        """Watch and write until `stop()`; `on_first_write` once every kind was seen and
        the first files are in place."""
        watchers = [
            threading.Thread(target=self._watch, args=(kind,), name=f"watch-{kind}", daemon=True)
            for kind in self.kinds
        ]
        for watcher in watchers:
            watcher.start()
        first = True
        while not self._stop.is_set():
            with self._changed:
                self._changed.wait_for(
                    lambda: (
                        self._stop.is_set() or (self._dirty and len(self._seen) == len(self.kinds))
                    )
                )
                if self._stop.is_set():
                    break
                entries = [e for found in self._seen.values() for e in found]
                self._dirty = False
            written = self.sync(entries)
            self.rounds += 1
            passing = sum(e.passing for e in entries)
            log.info(
                "endpoints: %d of %d instances passing; %d files written",
                passing,
                len(entries),
                len(written),
            )
            if first and on_first_write is not None:
                on_first_write()
            first = False

    def _watch(self, kind: ServiceKind) -> None:
        index = 0
        while not self._stop.is_set():
            try:
                found_index, entries = self.catalog.watch(kind, index, self.wait_s)
            except Exception as exc:  # the catalog unreachable: keep the files, ask again
                if self._stop.is_set():
                    return
                log.warning("catalog query for %s failed: %s", kind, exc)
                self._stop.wait(self.retry_s)
                index = 0
                continue
            # An index that goes back (the agent restarted) starts the wait afresh.
            index = found_index if found_index >= index else 0
            with self._changed:
                if self._seen.get(kind) != entries:
                    self._seen[kind] = entries
                    self._dirty = True
                    self._changed.notify_all()


def mark_ready(path: Path) -> Callable[[], None]:
    """A first-write callback that leaves a file saying so (a container's health check)."""

    def ready() -> None:
        atomic_write_text(path, "ready\n")

    return ready


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", required=True, help="resolved mesh spec")
    parser.add_argument("--ready-file", help="written once the first endpoint files are in place")


def run_from_args(args: argparse.Namespace) -> int:
    """Run the control plane of the spec until SIGTERM or SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    spec = load_resolved(args.spec)
    paths = MeshPaths(Path(spec.state_dir))
    plane = ControlPlane(spec, catalog_for(spec), paths)  # NoCatalog: one line, exit REFUSED

    def stop(signum: int, frame: FrameType | None) -> None:
        plane.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    ready = mark_ready(Path(args.ready_file)) if args.ready_file else None
    folders = ", ".join(str(layout.root / "eds") for _, layout in plane.targets)
    print(f"control plane: {spec.discovery.backend} catalog -> {folders}", flush=True)
    # The watch runs in a thread of its own, so this one stays free to take the signals.
    runner = threading.Thread(target=plane.run, args=(ready,), name="control-plane")
    runner.start()
    while runner.is_alive():
        runner.join(timeout=1.0)
    return 0
