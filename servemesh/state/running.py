"""The mesh running from a state dir, as a process outside it sees it: the resolved spec it
serves and what `servemesh up` wrote of its addresses and PIDs. Every command, the batch
scheduler and `servemesh top` find a running mesh through this one class."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servemesh.spec import ResolvedSpec
from servemesh.state.paths import MeshPaths


@dataclass(frozen=True)
class RunningMesh:
    state_dir: Path
    spec: ResolvedSpec

    @classmethod
    def at(cls, state_dir: Path) -> RunningMesh:
        """The mesh running from `state_dir`; NoRunningMesh when it holds no resolved spec."""
        return cls(state_dir, MeshPaths(state_dir).running_spec())

    @property
    def paths(self) -> MeshPaths:
        return MeshPaths(self.state_dir)

    def endpoints(self) -> dict[str, Any]:
        """What `up` wrote of its addresses and PIDs (empty before it wrote them)."""
        path = self.paths.endpoints
        return dict(json.loads(path.read_text())) if path.is_file() else {}

    def pids(self) -> dict[str, int]:
        """Each process `up` started, by name."""
        return {str(k): int(v) for k, v in dict(self.endpoints().get("pids") or {}).items()}

    def prometheus(self) -> str | None:
        """The address of the mesh's Prometheus, when it runs one."""
        address = self.endpoints().get("prometheus")
        return str(address) if address else None
