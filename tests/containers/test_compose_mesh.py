"""The compose mesh on the local images, for real: `make compose-up` (deploy/compose/dns.yml,
no Consul, no Jaeger: Envoy resolves the compose service names), a live weight change from
the host under load, canary rollouts run from the operator's container, a Predict through
the edge over TLS with the operator command line, and `make compose-down` leaving no
container, network or volume of the project behind.
The drills on containers run through the chaos suite: test_container_drills.py.

Marked `containers` (tests/conftest.py) and skipped without a Docker engine or
docker-compose. Every wait is on health or readiness, with bounds generous enough for a
small shared host; none of them is a sleep.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.containers.drive import answers_after, edge_load, engine_missing, failures, inspect

REPO = Path(__file__).resolve().parents[2]
TAG = os.environ.get("IMAGE_TAG", "dev")
# A project of its own, so a mesh someone started by hand is left alone.
PROJECT = "servemesh-dns-test"
EDGE_PORT = os.environ.get("SERVEMESH_TEST_EDGE_PORT", "18443")
ZONE_B_EDGE_PORT = os.environ.get("SERVEMESH_TEST_ZONE_B_EDGE_PORT", "18543")
RENDERED = REPO / "deploy" / "compose" / "rendered-dns"
LABEL = f"label=com.docker.compose.project={PROJECT}"

# A cold `make images` takes minutes; the mesh's start a minute or two on two cores.
pytestmark = pytest.mark.timeout(1800)


def make(*targets: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "SERVEMESH_EDGE_PORT": EDGE_PORT,
        "SERVEMESH_ZONE_B_EDGE_PORT": ZONE_B_EDGE_PORT,
    }
    return subprocess.run(
        ["make", *targets, f"IMAGE_TAG={TAG}", f"COMPOSE_PROJECT={PROJECT}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def leftovers() -> dict[str, list[str]]:
    """The project's containers, networks and volumes still in the engine."""
    found = {}
    for kind, cmd in {
        "containers": ["docker", "ps", "-a", "-q", "--filter", LABEL],
        "networks": ["docker", "network", "ls", "-q", "--filter", LABEL],
        "volumes": ["docker", "volume", "ls", "-q", "--filter", LABEL],
    }.items():
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
        found[kind] = done.stdout.split()
    return found


@pytest.fixture(scope="module")
def compose_mesh() -> Iterator[str]:
    reason = engine_missing("docker-compose")
    if reason is not None:
        pytest.skip(reason)
    started = time.monotonic()
    up = make("compose-up", timeout=1500)
    try:
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr[-4000:]
        print(f"make compose-up: {time.monotonic() - started:.1f} s")
        yield up.stdout
    finally:
        down = make("compose-down", timeout=300)
        assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]


def servemesh(*args: str) -> subprocess.CompletedProcess[str]:
    """The operator command line on the host, against the rendered state dir."""
    return subprocess.run(
        [str(REPO / ".venv" / "bin" / "servemesh"), *args, "--state-dir", str(RENDERED / "state")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_routes_set_on_the_host_moves_the_containers_weights_live_and_no_call_fails(
    compose_mesh: str,
) -> None:
    """`servemesh routes set` from the host, as on one machine: the route files it writes
    are in folders the Envoys mount, its confirmation comes through their admin sockets
    (mounted from the rendered state dir), and the load sees v2 answer, then v1 alone
    again, with no call failed."""
    with edge_load(EDGE_PORT) as load:
        half = servemesh("routes", "set", "fraud", "v1=50", "v2=50")
        assert half.returncode == 0, half.stdout + half.stderr
        assert "applied as change" in half.stdout, half.stdout
        moved_at = load.now_s()
        answers_after(load, moved_at, "answers at 50/50", count=60)
        back = servemesh("routes", "set", "fraud", "v1=100", "v2=0")
        assert back.returncode == 0, back.stdout + back.stderr
        back_at = load.now_s()
        answers_after(load, back_at, "answers at 100/0", count=40)
    outcomes, failed = failures(load)
    between = [o.version for o in outcomes if o.ok and moved_at < o.sent_s < back_at]
    after = [o.version for o in outcomes if o.ok and o.sent_s > back_at + 1]
    print(f"{len(outcomes)} calls, {len(failed)} failed; at 50/50: "
          f"{between.count('v2')} of {len(between)} from v2")  # fmt: skip
    assert not load.error, load.error
    assert failed == [], failed[:10]
    assert 0.2 < between.count("v2") / len(between) < 0.8, between
    assert set(after) == {"v1"}, after
    shown = servemesh("routes", "show", "--json")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    weights = {row["version"]: row["weight"] for row in json.loads(shown.stdout)}
    assert weights == {"v1": 100, "v2": 0}, shown.stdout
    history = (RENDERED / "state" / "routes-history.jsonl").read_text()
    assert "set fraud v1=50 v2=50" in history, history[-2000:]


def test_the_operator_container_lists_the_registry_s_models_with_their_live_weights(
    compose_mesh: str,
) -> None:
    """What the host cannot reach (the registry) through the operator's one-shot container
    on the mesh's networks: `make compose-operator ARGS="models list"`, the weights read
    from the Envoys' mounted admin sockets."""
    done = make("compose-operator", "ARGS=models list --json", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The command's one line of JSON, after make's echo of what it runs.
    listed = json.loads(next(x for x in reversed(done.stdout.splitlines()) if x.startswith("[{")))
    weights = {(row["model"], row["version"]): row["weight"] for row in listed}
    assert weights == {("fraud", "v1"): 100, ("fraud", "v2"): 0}, listed
    # One-shot: nothing of it is left running.
    running = subprocess.run(
        ["docker", "ps", "-q", "--filter", LABEL, "--filter",
         "label=com.docker.compose.service=operator"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    assert running == []


def test_a_traced_predict_is_read_back_whole_on_the_host(compose_mesh: str) -> None:
    """`predict --trace` through the edge: every hop (the edge's and the zone's Envoys, the
    gateway, feature and model containers) sends its spans to the trace store container,
    and `servemesh trace` on the host reads the trace whole from the rendered state dir."""
    from tests.waiting import wait_until

    done = subprocess.run(
        [str(REPO / ".venv" / "bin" / "servemesh"), "predict", "--model", "fraud",
         "--entity", "user-43", "--address", f"127.0.0.1:{EDGE_PORT}",
         "--spec", "deploy/compose/mesh-dns.yaml", "--state-dir", str(RENDERED / "state"),
         "--trace", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    request_id = json.loads(done.stdout)["request_id"]

    def services() -> set[str]:
        shown = servemesh("trace", request_id, "--json")
        if shown.returncode != 0:
            return set()
        return {span["service"] for span in json.loads(shown.stdout)["spans"]}

    def whole() -> bool:
        found = services()
        kinds = {name.split("-")[0] for name in found}
        return "envoy-edge" in found and {"gateway", "feature", "model"} <= kinds

    # Spans leave each process in batches (tracing.export_interval_ms): wait for the last.
    wait_until(whole, "every hop's spans of the trace", timeout_s=60)


def operator_rollout(plan: str) -> subprocess.CompletedProcess[str]:
    return make("compose-operator", f"ARGS=rollout start fraud v2 --plan {plan}", timeout=600)


def test_canaries_run_from_the_operator_container_roll_back_on_scores_and_promote_and_lose_no_call(
    compose_mesh: str,
) -> None:
    """`servemesh rollout start` in the operator's container (its networks reach each
    gateway's /metrics): it moves fraud's weights step by step through the Envoys' mounted
    files and admin sockets and judges each step on the gateways' counters. The demo's v2
    is another model, so the shipped plan rolls it back on its scores' distribution; a plan
    that does not judge scores promotes it. The load through the edge loses no call, and
    the host's command line reads what the container recorded."""
    # A plan the container reads from /work (the repository, mounted read-only): the
    # shipped one without a limit on the scores' distribution.
    loose = REPO / "build" / "test-plans" / "canary-any-scores.yaml"
    loose.parent.mkdir(parents=True, exist_ok=True)
    plan = yaml.safe_load((REPO / "deploy" / "compose" / "canary-plan.yaml").read_text())
    plan["analysis"]["max_psi"] = 1000
    loose.write_text(yaml.safe_dump(plan))
    with edge_load(EDGE_PORT) as load:
        judged = operator_rollout("deploy/compose/canary-plan.yaml")
        assert judged.returncode == 2, judged.stdout[-4000:] + judged.stderr[-4000:]
        assert "Error 3" in judged.stderr, judged.stderr[-2000:]  # the rollout's own status
        assert "rolled back: step 25%: psi fail" in judged.stdout, judged.stdout[-4000:]
        started_at = load.now_s()
        done = operator_rollout(str(loose.relative_to(REPO)))
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert "promoted: " in done.stdout, done.stdout[-4000:]
        promoted_at = load.now_s()
        answers_after(load, promoted_at, "answers after the promotion", count=40)
    outcomes, failed = failures(load)
    during = [o.version for o in outcomes if o.ok and started_at < o.sent_s < promoted_at]
    after = [o.version for o in outcomes if o.ok and o.sent_s > promoted_at + 1]
    print(f"{len(outcomes)} calls, {len(failed)} failed; during the promoted rollout "
          f"{during.count('v2')} of {len(during)} from v2")  # fmt: skip
    assert not load.error, load.error
    assert failed == [], failed[:10]
    assert {"v1", "v2"} <= set(during), during
    assert set(after) == {"v2"}, after

    # What the container recorded is the host's to read: the rollouts and the routes.
    history = servemesh("rollout", "history", "fraud", "--json")
    assert history.returncode == 0, history.stdout + history.stderr
    events = json.loads(history.stdout)
    ends = [(e["event"], e["version"]) for e in events if e["event"] in ("rolled_back", "promoted")]
    assert ends[-2:] == [("rolled_back", "v2"), ("promoted", "v2")], events
    steps = [e["step"] for e in events if e["event"] == "step"]
    assert steps[-3:] == ["25%", "50%", "100%"], events
    shown = servemesh("routes", "show", "--json")
    weights = {row["version"]: row["weight"] for row in json.loads(shown.stdout)}
    assert weights == {"v1": 0, "v2": 100}, shown.stdout
    # Back to v1 from the host, as an operator would after a demonstration.
    back = servemesh("routes", "set", "fraud", "v1=100", "v2=0")
    assert back.returncode == 0, back.stdout + back.stderr


def compose(*args: str, timeout: float = 300) -> str:
    """docker-compose on the test's project, as `make compose-up` ran it."""
    command = [
        "docker-compose", "-p", PROJECT, "--env-file", str(RENDERED / "compose.env"),
        "-f", str(REPO / "deploy" / "compose" / "dns.yml"), *args,
    ]  # fmt: skip
    env = {**os.environ, "IMAGE_TAG": TAG, "SERVEMESH_EDGE_PORT": EDGE_PORT,
           "SERVEMESH_ZONE_B_EDGE_PORT": ZONE_B_EDGE_PORT}  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def healthy(service: str) -> bool:
    ids = compose("ps", "-q", service).split()
    return bool(ids) and inspect(ids[0])["State"].get("Health", {}).get("Status") == "healthy"


def test_a_caller_given_both_edges_loses_no_call_while_the_first_edge_is_down(
    compose_mesh: str,
) -> None:
    """An edge per zone in containers too: the load dials both published edges as
    docs/architecture.md says ("Calling the mesh"); the first zone's edge container is
    killed and kept down, then started again, and not one call fails."""
    from tests.waiting import wait_until

    assert f"zone-b's edge: 127.0.0.1:{ZONE_B_EDGE_PORT}" in compose_mesh
    with edge_load(EDGE_PORT, ZONE_B_EDGE_PORT) as load:
        compose("kill", "envoy")
        killed_at = load.now_s()
        answers_after(load, killed_at, "answers with the first edge down", count=60)
        compose("start", "envoy")
        wait_until(lambda: healthy("envoy"), "the first edge healthy again", timeout_s=120)
        answers_after(load, load.now_s(), "answers with both edges up", count=40)
    outcomes, failed = failures(load)
    down = [o for o in outcomes if o.sent_s > killed_at]
    print(f"edge killed: {len(outcomes)} calls, {len(failed)} failed, {len(down)} after the kill")
    assert not load.error, load.error
    assert failed == [], failed[:10]


def test_zone_b_s_model_server_starts_from_its_mirror_with_the_registry_stopped(
    compose_mesh: str,
) -> None:
    """A registry either zone can start from, in containers: with registry-0 stopped,
    zone-b's model server container is started again and loads its versions from zone-b's
    mirror container (its log says which it used); a Predict is answered."""
    from tests.waiting import wait_until

    model_b = "model-fraud-zone-b-0"
    assert healthy("registry-mirror-zone-b")
    compose("stop", "-t", "10", "registry-0")
    try:
        compose("restart", "-t", "10", model_b)
        wait_until(lambda: healthy(model_b), f"{model_b} healthy again", timeout_s=300)
        log = compose("logs", "--no-color", model_b)
        assert "trying its zone's mirror" in log, log[-3000:]
        done = predict()
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        compose("start", "registry-0")
        wait_until(lambda: healthy("registry-0"), "registry-0 healthy again", timeout_s=300)


def predict() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "servemesh"),
            "predict",
            "--model",
            "fraud",
            "--entity",
            "user-42",
            "--address",
            f"127.0.0.1:{EDGE_PORT}",
            "--spec",
            "deploy/compose/mesh-dns.yaml",
            "--state-dir",
            str(RENDERED / "state"),
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_predict_through_the_compose_edge_then_down_leaves_nothing(compose_mesh: str) -> None:
    assert f"edge: 127.0.0.1:{EDGE_PORT}" in compose_mesh
    # Every container is healthy (the wait said so); the first call may still find a
    # cluster whose names Envoy has not resolved again yet: a bounded retry on that only.
    deadline = time.monotonic() + 120
    while True:
        started = time.monotonic()
        done = predict()
        if done.returncode == 0 or time.monotonic() > deadline:
            break
        assert "UNAVAILABLE" in done.stdout + done.stderr, done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"predict: {time.monotonic() - started:.2f} s")
    reply = json.loads(done.stdout)
    assert reply, done.stdout

    down = make("compose-down", timeout=300)
    assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
    assert leftovers() == {"containers": [], "networks": [], "volumes": []}
