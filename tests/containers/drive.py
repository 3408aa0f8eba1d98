"""What the container lane's tests share: a container's facts, a steady load through an
edge published on this host, and what that load saw."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servemesh.load import BackgroundLoad
    from servemesh.load.outcome import Outcome


def engine_missing(*tools: str) -> str | None:
    """Why the lane cannot run here (a client missing from PATH, no Docker engine
    answering), or None: each module skips with this reason."""
    for tool in ("docker", *tools):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH (apt-get install docker.io docker-compose)"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        return "no Docker engine answers (.ci/run starts one as root): " + info.stderr.strip()
    return None


def inspect(container: str) -> Any:
    done = subprocess.run(
        ["docker", "inspect", container], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(done.stdout)[0]


@contextmanager
def edge_load(port: str, *more: str) -> Iterator[BackgroundLoad]:
    """20 Predicts a second through the edge published at `port` on this host (its TLS and
    credentials as rendered; with `more` ports, every one of those edges as a caller is
    meant to connect), yielded once 20 have answered and stopped at the end; its outcomes
    stay readable."""
    from servemesh.bench.compose import edge_target, rendered_compose_spec
    from servemesh.load import BackgroundLoad
    from tests.waiting import wait_until

    addresses = [f"127.0.0.1:{p}" for p in (port, *more)]
    target = edge_target(
        rendered_compose_spec(), *addresses, subject="container-drill", entities=100
    )
    load = BackgroundLoad(target, rate_per_s=20.0)
    load.start()
    try:
        wait_until(lambda: sum(o.ok for o in load.outcomes) >= 20, "the load's first answers",
                   timeout_s=120)  # fmt: skip
        yield load
    finally:
        load.stop()


def answers_after(
    load: BackgroundLoad, since_s: float, what: str, count: int = 40, timeout_s: float = 120
) -> None:
    """Wait until `count` calls sent after `since_s` (the load's clock) have answered."""
    from tests.waiting import wait_until

    wait_until(lambda: sum(o.ok and o.sent_s > since_s for o in load.outcomes) >= count,
               what, timeout_s=timeout_s)  # fmt: skip


def failures(load: BackgroundLoad) -> tuple[list[Outcome], list[tuple[float, str]]]:
    """Every outcome of the load, and the failed ones as (sent at, code)."""
    outcomes = load.snapshot()
    return outcomes, [(round(o.sent_s, 2), o.code) for o in outcomes if not o.ok]
