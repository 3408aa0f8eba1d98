"""The same topology as a Docker Swarm stack, for real: `make swarm-up`
(deploy/compose/stack.yml on a single-node swarm, made for the run when the engine is in
none), two model tasks per zone behind one name that Envoy balances, zone placement by
node label, a rolling update of a model pool under load (start-first, health-gated) and a
killed task replaced by Swarm, each with no call failed; `make swarm-down` leaving no
service, network or secret of the stack, and the engine's swarm as it was.

Marked `containers` (tests/conftest.py) and skipped without a Docker engine. Every wait is
on Swarm's own state or the load's answers, none of them a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers.drive import answers_after, edge_load, engine_missing, failures, inspect

REPO = Path(__file__).resolve().parents[2]
TAG = os.environ.get("IMAGE_TAG", "dev")
# A stack of its own, so one someone deployed by hand is left alone.
STACK = "servemesh-swarm-test"
EDGE_PORT = os.environ.get("SERVEMESH_TEST_SWARM_EDGE_PORT", "18444")
ZONE_B_EDGE_PORT = os.environ.get("SERVEMESH_TEST_SWARM_ZONE_B_EDGE_PORT", "18544")
RENDERED = REPO / "deploy" / "compose" / "rendered-dns"
LABEL = f"label=com.docker.stack.namespace={STACK}"
POOL_A = f"{STACK}_model-fraud-zone-a-0"

pytestmark = pytest.mark.timeout(1800)


def docker(*args: str, timeout: float = 60) -> str:
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


def make(*targets: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "SERVEMESH_EDGE_PORT": EDGE_PORT,
        "SERVEMESH_ZONE_B_EDGE_PORT": ZONE_B_EDGE_PORT,
    }
    return subprocess.run(
        ["make", *targets, f"IMAGE_TAG={TAG}", f"SWARM_STACK={STACK}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def swarm_state() -> str:
    return docker("info", "--format", "{{.Swarm.LocalNodeState}}").strip()


def gwbridge() -> str:
    found = docker("network", "ls", "-q", "--filter", "name=^docker_gwbridge$").split()
    return found[0] if found else ""


def leftovers() -> dict[str, list[str]]:
    return {
        "services": docker("service", "ls", "-q", "--filter", LABEL).split(),
        "networks": docker("network", "ls", "-q", "--filter", LABEL).split(),
        "secrets": docker("secret", "ls", "-q", "--filter", LABEL).split(),
    }


@pytest.fixture(scope="module")
def swarm_stack() -> Iterator[str]:
    reason = engine_missing()
    if reason is not None:
        pytest.skip(reason)
    before = swarm_state()
    networks_before = set(docker("network", "ls", "-q").split()) | {gwbridge()}
    up = make("swarm-up", timeout=1500)
    try:
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        yield up.stdout
    finally:
        down = make("swarm-down", timeout=300)
        assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
        # A swarm that swarm-up made is left again; one that was there stays.
        assert swarm_state() == before
        if before == "active":
            assert leftovers() == {"services": [], "networks": [], "secrets": []}
        # The engine's bridge for swarms (docker_gwbridge) stays, as the engine's own.
        assert set(docker("network", "ls", "-q").split()) - {gwbridge()} <= networks_before


def running_tasks(service: str) -> dict[str, str]:
    """The service's tasks Swarm counts as running (healthy, for a service with a health
    check), by task id: each one's container id."""
    tasks = {}
    for line in docker("service", "ps", service, "--filter", "desired-state=running",
                       "--format", "{{.ID}} {{.CurrentState}}").splitlines():  # fmt: skip
        task, state = line.split(" ", 1)
        if state.startswith("Running"):
            facts = json.loads(docker("inspect", task))[0]
            tasks[task] = facts["Status"]["ContainerStatus"]["ContainerID"]
    return tasks


def replicas(service: str) -> tuple[int, int]:
    text = docker("service", "ls", "--filter", f"name={service}", "--format", "{{.Replicas}}")
    running, wanted = text.split()[0].split("/")
    return int(running), int(wanted)


def healthy_per_zone() -> dict[str, int]:
    """How many hosts of fraud v1 Envoy holds healthy in each zone (`routes show`)."""
    done = subprocess.run(
        [str(REPO / ".venv" / "bin" / "servemesh"), "routes", "show", "--json",
         "--state-dir", str(RENDERED / "state")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(r for r in json.loads(done.stdout) if r["version"] == "v1")
    return dict(row["healthy"])


def test_each_zone_s_pool_runs_two_tasks_on_its_zone_s_nodes_and_envoy_holds_both(
    swarm_stack: str,
) -> None:
    assert f"edge: 127.0.0.1:{EDGE_PORT}" in swarm_stack
    node = docker("info", "--format", "{{.Swarm.NodeID}}").strip()
    labels = json.loads(docker("node", "inspect", node))[0]["Spec"]["Labels"]
    assert labels.get("servemesh.zone-a") == "true" and labels.get("servemesh.zone-b") == "true"
    for zone in ("zone-a", "zone-b"):
        service = f"{STACK}_model-fraud-{zone}-0"
        assert replicas(service) == (2, 2)
        spec = json.loads(docker("service", "inspect", service))[0]["Spec"]
        constraints = spec["TaskTemplate"]["Placement"]["Constraints"]
        assert constraints == [f"node.labels.servemesh.{zone} == true"], constraints
        assert spec["EndpointSpec"]["Mode"] == "dnsrr"
    assert healthy_per_zone() == {"zone-a": 2, "zone-b": 2}


def test_a_rolling_update_of_a_model_pool_under_load_fails_no_call(swarm_stack: str) -> None:
    """`docker service update --force`: every task of zone-a's pool replaced, one at a
    time, each new one started and healthy before an old one stops (the stack's
    update_config); the load through the edge loses nothing."""
    before = running_tasks(POOL_A)
    assert len(before) == 2, before
    with edge_load(EDGE_PORT) as load:
        started_at = load.now_s()
        docker("service", "update", "--force", "--detach=false", "--quiet", POOL_A, timeout=600)
        updated_at = load.now_s()
        answers_after(load, updated_at, "answers after the update")
    after = running_tasks(POOL_A)
    status = json.loads(docker("service", "inspect", POOL_A))[0].get("UpdateStatus", {})
    outcomes, failed = failures(load)
    print(f"rolling update: {updated_at - started_at:.1f} s, {len(outcomes)} calls, "
          f"{len(failed)} failed")  # fmt: skip
    assert status.get("State") == "completed", status
    assert len(after) == 2 and not set(after) & set(before), (before, after)
    assert not load.error, load.error
    assert failed == [], failed[:10]
    assert sum(started_at < o.sent_s < updated_at for o in outcomes) > 100


def test_a_killed_model_task_is_replaced_by_swarm_and_no_call_fails(swarm_stack: str) -> None:
    from tests.waiting import wait_until

    before = running_tasks(POOL_A)
    victim_task, victim = sorted(before.items())[0]
    with edge_load(EDGE_PORT) as load:
        # A crash from outside the engine: the task fails, and Swarm schedules another.
        os.kill(int(inspect(victim)["State"]["Pid"]), signal.SIGKILL)
        killed_at = load.now_s()
        wait_until(lambda: len(set(running_tasks(POOL_A)) - set(before)) == 1,
                   "a new task running (healthy) in the killed one's place",
                   timeout_s=300)  # fmt: skip
        replaced_s = load.now_s() - killed_at
        answers_after(load, load.now_s(), "answers after the replacement")
    after = running_tasks(POOL_A)
    outcomes, failed = failures(load)
    print(f"task replaced {replaced_s:.1f} s after the kill; {len(outcomes)} calls, "
          f"{len(failed)} failed")  # fmt: skip
    assert victim_task not in after and len(after) == 2, (before, after)
    assert not load.error, load.error
    assert failed == [], failed[:10]
