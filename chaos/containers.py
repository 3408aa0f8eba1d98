"""The mesh a container drill runs against: a compose project of deploy/compose/dns.yml that
the drill itself renders, starts, drives through the Docker engine and removes.

A drill with `mesh: compose` gets one of these instead of a process mesh. It is the same
topology `make compose-up` starts (its render, its images, its health checks), under a
project name of the drill's own and an edge port picked free, so a compose mesh someone
started by hand is never touched: the drill refuses to start while another project of the
same compose file runs (they would share the rendered folder, and with it the Envoys'
admin sockets). Faults are what an operator of containers meets: a container's process
killed from the host (the engine restarts it), a container stopped or frozen, a zone's
Envoy cut from the other zone's network, a zone's cgroups throttled.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from servemesh.chaos.errors import DrillError
from servemesh.discovery.compose import render_compose
from servemesh.spec import ResolvedSpec
from servemesh.state.paths import MeshPaths

# The images the compose file runs (`make images` builds them).
IMAGES = ("servemesh-service", "servemesh-model", "servemesh-envoy", "servemesh-redis")
# How long an engine command may take on a busy small host.
DOCKER_TIMEOUT_S = 120.0


def docker(*args: str, timeout_s: float = DOCKER_TIMEOUT_S) -> str:
    """Run a docker command; its output, or a DrillError with what the engine said."""
    try:
        done = subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError:
        raise DrillError("no docker on PATH: container drills need a Docker engine") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise DrillError(f"docker {' '.join(args[:3])}: {' '.join(said)}")
    return done.stdout


def _when(stamp: str) -> datetime:
    """An engine timestamp (RFC 3339, nanoseconds, `Z` or an offset) as a datetime."""
    head, _, rest = stamp.partition(".")
    if not rest:  # no fraction: the offset follows the seconds
        return datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    digits = rest[: len(rest) - len(rest.lstrip("0123456789"))]
    offset = rest[len(digits) :].replace("Z", "+00:00") or "+00:00"
    return datetime.fromisoformat(f"{head}.{digits[:6].ljust(6, '0')}{offset}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class ComposeMesh:
    compose_file: Path
    compose_spec: Path
    project: str
    image_tag: str = "dev"
    edge_port: int = field(default_factory=_free_port)
    zone_b_edge_port: int = field(default_factory=_free_port)
    ready_timeout_s: float = 600.0
    _spec: ResolvedSpec | None = None

    @property
    def rendered(self) -> Path:
        """The folder the compose file mounts from (`./rendered-dns` beside it)."""
        return self.compose_file.parent / "rendered-dns"

    @property
    def state_dir(self) -> Path:
        return self.rendered / "state"

    @property
    def paths(self) -> MeshPaths:
        return MeshPaths(self.state_dir)

    @property
    def spec(self) -> ResolvedSpec:
        """The resolved spec, as commands on this host read it (this state dir's paths)."""
        if self._spec is None:
            raise DrillError("the drill's compose mesh is not running")
        return self._spec

    @property
    def edge_address(self) -> str:
        return f"127.0.0.1:{self.edge_port}"

    # --- start and stop ------------------------------------------------------------------

    def _compose(self, *args: str, timeout_s: float = DOCKER_TIMEOUT_S) -> str:
        env = {
            **os.environ,
            "IMAGE_TAG": self.image_tag,
            "SERVEMESH_EDGE_PORT": str(self.edge_port),
            "SERVEMESH_ZONE_B_EDGE_PORT": str(self.zone_b_edge_port),
        }
        command = [
            "docker-compose", "-p", self.project,
            "--env-file", str(self.rendered / "compose.env"), "-f", str(self.compose_file),
            *args,
        ]  # fmt: skip
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, env=env, timeout=timeout_s, check=False
            )
        except FileNotFoundError:
            raise DrillError("no docker-compose on PATH (apt-get install docker-compose)") from None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise DrillError(f"docker-compose {args[0]}: {' '.join(said)}")
        return done.stdout

    def start(self) -> None:
        """Render, start the project and wait until every container is healthy (the seed:
        exited 0)."""
        self._refuse_a_neighbour()
        missing = [
            image
            for image in IMAGES
            if subprocess.run(
                ["docker", "image", "inspect", f"{image}:{self.image_tag}"],
                capture_output=True,
                timeout=DOCKER_TIMEOUT_S,
                check=False,
            ).returncode
            != 0  # fmt: skip
        ]
        if missing:
            raise DrillError(f"no image {missing} with tag {self.image_tag}: run `make images`")
        render_compose(self.compose_spec, self.rendered)
        self._compose("up", "-d", timeout_s=self.ready_timeout_s)
        self._wait_healthy()
        self._spec = self.paths.running_spec()

    def _refuse_a_neighbour(self) -> None:
        label = f"label=com.docker.compose.project.working_dir={self.compose_file.parent}"
        found = docker("ps", "-a", "--filter", label, "--format",
                       '{{.Label "com.docker.compose.project"}}').split()  # fmt: skip
        others = sorted(set(found) - {self.project})
        if others:
            raise DrillError(
                f"compose project {others[0]} runs from {self.compose_file.parent}: it shares "
                "the rendered folder a drill's project would use; take it down first"
            )

    def _wait_healthy(self) -> None:
        give_up = time.monotonic() + self.ready_timeout_s
        while True:
            states = self._states()
            pending = {s: st for s, st in states.items() if st not in ("healthy", "exited 0")}
            if states and not pending:
                return
            failed = {s: st for s, st in pending.items() if st in ("unhealthy", "exited")}
            if failed or time.monotonic() > give_up:
                raise DrillError(f"the drill's compose mesh did not come up: {failed or pending}")
            time.sleep(1.0)

    def _states(self) -> dict[str, str]:
        """Each container's service: healthy, unhealthy, starting, running (no check),
        `exited 0` or exited."""
        states = {}
        for service, container in self.containers().items():
            facts = self.inspect(container)["State"]
            if facts["Status"] == "exited":
                states[service] = "exited 0" if facts["ExitCode"] == 0 else "exited"
            else:
                states[service] = (facts.get("Health") or {}).get("Status", facts["Status"])
        return states

    def stop(self) -> None:
        """Remove every container, network and volume of the project."""
        self._compose("down", "--volumes", "--remove-orphans", "--timeout", "20")

    # --- the engine's view -----------------------------------------------------------------

    def containers(self) -> dict[str, str]:
        """The project's containers by compose service name."""
        out = docker("ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
                     "--format", '{{.Label "com.docker.compose.service"}} {{.ID}}')  # fmt: skip
        return dict(line.split() for line in out.splitlines() if line.strip())

    def container(self, service: str) -> str:
        found = self.containers().get(service)
        if found is None:
            raise DrillError(f"no container of service {service!r} in {self.project}")
        return found

    def inspect(self, container: str) -> dict[str, Any]:
        return dict(json.loads(docker("inspect", container))[0])

    def zone_services(self, zone: str) -> list[str]:
        """A zone's own containers: its Envoy and its gateway, feature and model replicas."""
        names = [f"envoy-{zone}"] + [
            i.name
            for i in self.spec.instances()
            if i.zone == zone and i.service in ("gateway", "feature", "model")
        ]
        return [n for n in names if n in self.containers()]

    def network(self, zone: str) -> str:
        return f"{self.project}_{zone}"

    def healthy(self, service: str) -> bool:
        """Healthy by a check made since the container last started: the engine keeps the
        status a stopped container had until its next check after a start."""
        state = self.inspect(self.container(service))["State"]
        health = state.get("Health") or {}
        checks = health.get("Log") or []
        return bool(
            health.get("Status") == "healthy"
            and checks
            and _when(checks[-1]["Start"]) > _when(state["StartedAt"])
        )

    def restarts(self, service: str) -> int:
        return int(self.inspect(self.container(service))["RestartCount"])

    def reaches(self, service: str, address: str) -> bool:
        """Whether `service`'s container opens a TCP connection to `address` within 2 s
        (perl is in every image: the Debian base's)."""
        probe = f"exit !IO::Socket::INET->new(PeerAddr => q({address}), Timeout => 2)"
        done = subprocess.run(
            ["docker", "exec", self.container(service), "perl", "-MIO::Socket::INET", "-e", probe],
            capture_output=True, text=True, timeout=DOCKER_TIMEOUT_S, check=False,
        )  # fmt: skip
        return done.returncode == 0

    # --- faults ----------------------------------------------------------------------------

    def crash(self, service: str) -> int:
        """SIGKILL the container's process from the host: a crash, which the restart
        policy answers (`docker kill` is a deliberate stop, which it leaves down)."""
        pid = int(self.inspect(self.container(service))["State"]["Pid"])
        if pid <= 0:
            raise DrillError(f"{service}'s container is not running")
        os.kill(pid, signal.SIGKILL)
        return pid

    def throttled_periods(self, service: str) -> int:
        """CFS periods the container's cgroup was throttled in (cpu.stat), read on the host:
        cgroup v1 (cgroupfs or systemd) or v2."""
        full = self.inspect(self.container(service))["Id"]
        for pattern in (
            f"/sys/fs/cgroup/cpu/docker/{full}/cpu.stat",
            f"/sys/fs/cgroup/cpu,cpuacct/docker/{full}/cpu.stat",
            f"/sys/fs/cgroup/cpu/system.slice/docker-{full}.scope/cpu.stat",
            f"/sys/fs/cgroup/system.slice/docker-{full}.scope/cpu.stat",
            f"/sys/fs/cgroup/docker/{full}/cpu.stat",
        ):
            path = Path(pattern)
            if path.exists():
                fields = dict(line.split() for line in path.read_text().splitlines())
                return int(fields["nr_throttled"])
        raise DrillError(f"no cpu.stat found for {service}'s container")
