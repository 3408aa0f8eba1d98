"""Where a mesh keeps its state: the layout of its state dir (the resolved spec, its
endpoints, each Envoy's watched files and bootstrap, the routes history, logs), and the
lock that lets one change at a time touch it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from servemesh.contract.errors import NoMesh, ServemeshError
from servemesh.contract.private import open_lock
from servemesh.spec import (
    EDGE_PROXY,
    ResolvedSpec,
    SpecError,
    load_resolved,
    load_spec,
    proxy_part,
)


class ApplyError(ServemeshError, ValueError):
    """The change was refused; the live configuration is untouched."""

    label = "refused"


class NoRunningMesh(NoMesh, SpecError):
    """No mesh runs from this state dir: it holds no resolved spec (exit status 2)."""


# Per thread: the state dirs whose change lock it holds, and how deeply (see change_lock).
_HELD = threading.local()
_PROCESS_LOCKS: dict[Path, threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


def _process_lock(state_dir: Path) -> threading.Lock:
    """The lock this process's threads take turns on for one mesh's changes."""
    with _PROCESS_LOCKS_GUARD:
        return _PROCESS_LOCKS.setdefault(state_dir, threading.Lock())


@dataclass(frozen=True)
class XdsLayout:
    """Where the watched resource files live under a mesh's state dir."""

    root: Path

    @property
    def cds(self) -> Path:
        return self.root / "cds" / "clusters.yaml"

    def eds(self, cluster: str) -> Path:
        return self.root / "eds" / f"{cluster}.yaml"

    def rds(self, route_config: str) -> Path:
        return self.root / "rds" / f"{route_config}.yaml"

    def eds_files(self) -> list[Path]:
        """Every endpoint file on disk now."""
        folder = self.root / "eds"
        return sorted(folder.iterdir()) if folder.is_dir() else []


@dataclass(frozen=True)
class MeshPaths:
    """Where a running mesh keeps what `routes` commands read and write."""

    state_dir: Path

    @classmethod
    def of(cls, state_dir: str | Path | None) -> MeshPaths:
        """A command's `--state-dir`, else the spec's (`.servemesh` unless it says other);
        a spec that does not load is refused (ApplyError), naming what is wrong."""
        if state_dir:
            return cls(Path(state_dir))
        try:
            return cls(Path(load_spec(None).state_dir))
        except SpecError as exc:
            raise ApplyError(str(exc)) from None

    def running_spec(self) -> ResolvedSpec:
        """The resolved spec the mesh running from this state dir wrote (what every
        command that talks to a running mesh reads)."""
        if not self.resolved_spec.is_file():
            raise NoRunningMesh(self.state_dir)
        spec = load_resolved(self.resolved_spec)
        if self.envoys_mount.is_file():
            # A mesh in containers: its spec names their state dir; a command here reads
            # and writes this one (its certificates, history, admin sockets).
            spec = spec.model_copy(update={"state_dir": str(self.state_dir)})
        return spec

    @contextlib.contextmanager
    def change_lock(self) -> Iterator[None]:
        """Hold the mesh's one change at a time: a second `apply`, `routes set` or
        `rollback` from another process while one is under way is refused at once instead
        of interleaving its Envoy swap and spec write with the first one's. Threads of one
        process take turns; the lock is re-entrant within a thread (an apply holds it across
        its loads and the swap it then asks for)."""
        key = self.state_dir.resolve()
        depth: dict[Path, int] = _HELD.__dict__.setdefault("depth", {})
        if depth.get(key):
            depth[key] += 1
            try:
                yield
            finally:
                depth[key] -= 1
            return
        with _process_lock(key):
            self.state_dir.mkdir(parents=True, exist_ok=True)
            with open_lock(self.state_dir / "changes.lock", "r+") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.seek(0)
                    holder = handle.read().strip() or "?"
                    raise ApplyError(
                        f"another change to this mesh is under way (pid {holder}); "
                        "run this one when it has finished"
                    ) from None
                handle.seek(0)
                handle.truncate()
                handle.write(str(os.getpid()))
                handle.flush()
                depth[key] = 1
                try:
                    yield
                finally:
                    del depth[key]
                    handle.truncate(0)
                    fcntl.flock(handle, fcntl.LOCK_UN)

    @property
    def resolved_spec(self) -> Path:
        return self.state_dir / "mesh.resolved.yaml"

    @property
    def envoys_mount(self) -> Path:
        """Where the mesh's Envoys see this state dir, when that is not here: a mesh in
        containers (`servemesh compose init` writes it) mounts the folder elsewhere, and
        the files a live change writes must name the paths its Envoys read."""
        return self.state_dir / "envoys-mount"

    def as_envoys_see_it(self) -> MeshPaths:
        """This state dir as the mesh's Envoys see it: itself on one machine, the
        containers' mount point (envoys_mount) for a mesh in containers."""
        if self.envoys_mount.is_file():
            return MeshPaths(Path(self.envoys_mount.read_text().strip()))
        return self

    def here(self, seen: Path) -> Path:
        """A path as the Envoys see it (under as_envoys_see_it()), as it lies here."""
        inside = self.as_envoys_see_it().state_dir
        return seen if inside == self.state_dir else self.state_dir / seen.relative_to(inside)

    @property
    def endpoints(self) -> Path:
        return self.state_dir / "endpoints.json"

    @property
    def xds(self) -> XdsLayout:
        """The edge Envoy's watched files (the shared layout's only Envoy's)."""
        return XdsLayout(self.state_dir / "xds")

    def xds_of(self, proxy: str) -> XdsLayout:
        """One of the mesh's Envoys' watched files: a zone Envoy's under xds-<zone>."""
        return self.xds if proxy == EDGE_PROXY else XdsLayout(self.state_dir / f"xds-{proxy}")

    @property
    def history(self) -> Path:
        return self.state_dir / "routes-history.jsonl"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def envoy_config(self) -> Path:
        return self.state_dir / "envoy" / "envoy.yaml"

    def envoy_config_of(self, proxy: str) -> Path:
        """One of the mesh's Envoys' bootstrap, named by its part: envoy/envoy.yaml (the
        edge's), envoy/envoy-<zone>.yaml (a zone's)."""
        return self.envoy_config.with_name(f"{proxy_part(proxy)}.yaml")
