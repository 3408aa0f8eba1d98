"""The compose mesh on the local images, for real: `make compose-up` (deploy/compose/dns.yml,
no Consul, no Jaeger: Envoy resolves the compose service names), then drills under load
through the edge: a model server container crashing (its process SIGKILLed from the host:
the engine starts it again, the other zone answers meanwhile, no call fails), a zone
paused, a zone's Envoy crashing, the registry stopped, a partition between the zones'
networks, a zone's containers CPU-throttled; a Predict through the edge over TLS with the
operator command line, and `make compose-down` leaving no container, network or volume of
the project behind.

Marked `containers` (tests/conftest.py) and skipped without a Docker engine or
docker-compose. Every wait is on health or readiness, with bounds generous enough for a
small shared host; none of them is a sleep.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers.drive import answers_after, edge_load, failures, inspect

REPO = Path(__file__).resolve().parents[2]
TAG = os.environ.get("IMAGE_TAG", "dev")
# A project of its own, so a mesh someone started by hand is left alone.
PROJECT = "servemesh-dns-test"
EDGE_PORT = os.environ.get("SERVEMESH_TEST_EDGE_PORT", "18443")
RENDERED = REPO / "deploy" / "compose" / "rendered-dns"
LABEL = f"label=com.docker.compose.project={PROJECT}"

# A cold `make images` takes minutes; the mesh's start a minute or two on two cores.
pytestmark = pytest.mark.timeout(1800)


def _missing() -> str | None:
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH (apt-get install docker.io docker-compose)"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    if info.returncode != 0:
        return "no Docker engine answers: " + info.stderr.strip()
    return None


def make(*targets: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SERVEMESH_EDGE_PORT": EDGE_PORT}
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
    reason = _missing()
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


def container_of(service: str) -> str:
    found = subprocess.run(
        ["docker", "ps", "-q", "--filter", LABEL, "--filter",
         f"label=com.docker.compose.service={service}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    assert len(found) == 1, (service, found)
    return found[0]


def healthy_again(container: str, restarts: int) -> bool:
    facts = inspect(container)
    health = facts["State"].get("Health") or {}
    return bool(facts["RestartCount"] > restarts and health.get("Status") == "healthy")


def test_a_model_server_container_that_crashes_is_started_again_and_no_call_fails(
    compose_mesh: str,
) -> None:
    from tests.waiting import wait_until

    victim = container_of("model-fraud-zone-a-0")
    restarts = int(inspect(victim)["RestartCount"])
    with edge_load(EDGE_PORT) as load:
        state = inspect(victim)["State"]
        # A crash, not a stop: the process dies from outside the engine (`docker kill` is a
        # deliberate stop, which a restart policy leaves down).
        os.kill(int(state["Pid"]), signal.SIGKILL)
        crashed_at = load.now_s()
        wait_until(lambda: healthy_again(victim, restarts), "the container healthy again",
                   timeout_s=300)  # fmt: skip
        back_s = load.now_s() - crashed_at
        wait_until(lambda: sum(o.ok and o.sent_s > load.now_s() - 1 for o in load.outcomes) > 5,
                   "answers after the restart", timeout_s=60)  # fmt: skip
    outcomes, failed = failures(load)
    print(f"{len(outcomes)} calls, {len(failed)} failed; healthy again {back_s:.1f} s after")
    assert not load.error, load.error
    assert failed == [], failed[:10]
    assert sum(o.sent_s > crashed_at for o in outcomes) > 20


ZONE_A = ["envoy-zone-a", "gateway-zone-a-0", "feature-zone-a-0", "model-fraud-zone-a-0"]


def test_a_zone_whose_containers_are_all_paused_loses_only_the_calls_it_froze(
    compose_mesh: str,
) -> None:
    """Every container of zone-a frozen (`docker pause`: nothing answers, nothing refuses)
    for as long as 100 calls take, then thawed. The edge never retries a call a gateway
    accepted (traffic.edge has no per-try timeout: a gateway busy downstream is no
    failure), so a call the edge sends to zone-a's frozen gateway runs out its deadline
    until the edge's health checks eject it (two checks in a row unanswered); every call
    after that goes to zone-b, and every call after the thaw answers."""
    from servemesh.bench.compose import rendered_compose_spec
    from tests.waiting import wait_until

    zone_a = [container_of(service) for service in ZONE_A]
    with edge_load(EDGE_PORT) as load:
        pausing_at = load.now_s()
        subprocess.run(["docker", "pause", *zone_a], check=True, timeout=60)
        try:
            paused_at = load.now_s()
            wait_until(lambda: sum(o.sent_s > paused_at for o in load.outcomes) >= 100,
                       "100 calls with zone-a paused", timeout_s=120)  # fmt: skip
        finally:
            subprocess.run(["docker", "unpause", *zone_a], check=True, timeout=60)
        thawed_at = load.now_s()
        answers_after(load, thawed_at, "answers after the thaw")
    outcomes, failed = failures(load)
    during = [o for o in outcomes if pausing_at <= o.sent_s < thawed_at]
    print(
        f"{len(outcomes)} calls ({len(during)} while paused), {len(failed)} failed: {failed}; "
        f"docker pause took {paused_at - pausing_at:.2f} s"
    )
    assert not load.error, load.error
    assert len(during) >= 100
    # Only calls sent to the frozen gateway before its ejection fail, by their deadline:
    # none before the freeze, none once two health checks (and their timeouts) had time to
    # go unanswered, none after the thaw.
    checks = rendered_compose_spec().traffic.edge.health_checks
    ejected_within_s = (checks.unhealthy_threshold * checks.interval_ms + checks.timeout_ms
                        + 1000) / 1000  # fmt: skip
    assert {code for _, code in failed} <= {"DEADLINE_EXCEEDED"}, failed
    assert all(pausing_at <= sent < pausing_at + ejected_within_s for sent, _ in failed), (
        ejected_within_s,
        failed,
    )


def test_a_zone_envoy_container_that_crashes_costs_its_zone_seconds_and_is_started_again(
    compose_mesh: str,
) -> None:
    """zone-a's Envoy process SIGKILLed from the host under load: the engine starts the
    container again; meanwhile zone-a's gateway says its way downstream is gone
    (x-servemesh-retry-elsewhere) and the edge tries those calls on zone-b's gateway, so at
    most 2% fail (the process mesh's bound, tests/mesh/test_zone_proxies.py), each one
    UNAVAILABLE, none once the Envoy is healthy again."""
    from tests.waiting import wait_until

    victim = container_of("envoy-zone-a")
    restarts = int(inspect(victim)["RestartCount"])
    with edge_load(EDGE_PORT) as load:
        os.kill(int(inspect(victim)["State"]["Pid"]), signal.SIGKILL)
        crashed_at = load.now_s()
        wait_until(lambda: healthy_again(victim, restarts), "zone-a's Envoy healthy again",
                   timeout_s=300)  # fmt: skip
        back_at = load.now_s()
        answers_after(load, back_at, "answers after the Envoy's return")
    outcomes, failed = failures(load)
    print(f"{len(outcomes)} calls, {len(failed)} failed: {failed[:10]}; healthy again "
          f"{back_at - crashed_at:.1f} s after the kill")  # fmt: skip
    assert not load.error, load.error
    assert len(failed) <= 0.02 * len(outcomes), failed
    assert {code for _, code in failed} <= {"UNAVAILABLE"}, failed
    # A call still in flight on the old Envoy may end just after the new one is healthy;
    # none sent a second after that fails.
    assert all(sent < back_at + 1 for sent, _ in failed), (back_at, failed)


def test_with_the_registry_container_stopped_serving_goes_on(compose_mesh: str) -> None:
    """The registry stopped under load (`docker stop`: a deliberate outage, which the
    restart policy leaves down) and started again: the model servers hold what they
    loaded, so no Predict fails, and the registry is healthy again after its start."""
    from tests.waiting import wait_until

    registry = container_of("registry-0")
    with edge_load(EDGE_PORT) as load:
        subprocess.run(["docker", "stop", registry], check=True, timeout=120)
        try:
            stopped_at = load.now_s()
            assert inspect(registry)["State"]["Running"] is False
            wait_until(lambda: sum(o.sent_s > stopped_at for o in load.outcomes) >= 100,
                       "100 calls with the registry down", timeout_s=120)  # fmt: skip
        finally:
            subprocess.run(["docker", "start", registry], check=True, timeout=120)
        wait_until(lambda: (inspect(registry)["State"].get("Health") or {}).get("Status")
                   == "healthy", "the registry healthy again", timeout_s=300)  # fmt: skip
    outcomes, failed = failures(load)
    print(f"{len(outcomes)} calls, {len(failed)} failed with the registry stopped")
    assert not load.error, load.error
    assert sum(o.sent_s > stopped_at for o in outcomes) >= 100
    assert failed == [], failed[:10]


def throttled_periods(container: str) -> int:
    """How many CFS periods the container's cgroup was throttled in (cpu.stat's
    nr_throttled), read on the host: cgroup v1 (cgroupfs or systemd) or v2."""
    full = inspect(container)["Id"]
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
    raise AssertionError(f"no cpu.stat found for container {full}")


def test_a_zone_throttled_by_its_cgroups_is_served_around_and_loses_no_call(
    compose_mesh: str,
) -> None:
    """A brownout: every container of zone-a limited to a twentieth of a core (`docker update
    --cpus 0.05`) under load, then given the host's cores back. The throttle is real (the
    cgroups count throttled periods); the edge's least-request balancing finds zone-a's
    gateway slower (its calls stay in flight longer) and sends zone-b a larger share than
    before; no call fails (nothing in the policy gives up on a slow answer within the
    callers' deadline)."""
    from tests.waiting import wait_until

    zone_a = [container_of(service) for service in ZONE_A]
    cores = str(os.cpu_count() or 1)
    with edge_load(EDGE_PORT) as load:
        before_at = load.now_s()
        answers_after(load, before_at, "150 answers before the brownout", 150, timeout_s=180)
        throttled = {c: throttled_periods(c) for c in zone_a}
        subprocess.run(["docker", "update", "--cpus", "0.05", *zone_a], check=True, timeout=60)
        try:
            slow_at = load.now_s()
            wait_until(lambda: sum(o.sent_s > slow_at for o in load.outcomes) >= 250,
                       "250 calls in the brownout", timeout_s=240)  # fmt: skip
            ended_at = load.now_s()
            grew = {c: throttled_periods(c) - n for c, n in throttled.items()}
        finally:
            subprocess.run(["docker", "update", "--cpus", cores, *zone_a], check=True, timeout=60)
        answers_after(load, ended_at, "answers after the brownout")
    outcomes, failed = failures(load)

    def zone_b_share(first: float, last: float) -> float:
        window = [o for o in outcomes if o.ok and first <= o.sent_s < last]
        return sum(o.zone == "zone-b" for o in window) / max(1, len(window))

    before, during = zone_b_share(before_at, slow_at), zone_b_share(slow_at, ended_at)
    print(f"{len(outcomes)} calls, {len(failed)} failed: {failed[:10]}; zone-b's share "
          f"{before:.0%} before, {during:.0%} in the brownout; throttled {grew}")  # fmt: skip
    assert not load.error, load.error
    assert max(grew.values()) > 0, grew  # the limit bit
    assert failed == [], failed[:10]
    assert during > before, (before, during)
    # And the callers feel it where zone-a still answers: its median answer is slower (a
    # zone-a the edge no longer sends to at all has been served around completely).
    zone_a_ms = [
        [o.latency_ms for o in outcomes if o.ok and o.zone == "zone-a" and first <= o.sent_s < last]
        for first, last in ((before_at, slow_at), (slow_at, ended_at))
    ]
    if len(zone_a_ms[1]) >= 10:
        assert statistics.median(zone_a_ms[1]) > statistics.median(zone_a_ms[0]), zone_a_ms
    else:
        assert during > 0.9, (before, during)


def reaches(container: str, address: str) -> bool:
    """Whether `container` opens a TCP connection to `address` (host:port, by name) within
    2 s: perl is in every Debian base image, the Envoy image's included."""
    probe = f"exit !IO::Socket::INET->new(PeerAddr => q({address}), Timeout => 2)"
    done = subprocess.run(
        ["docker", "exec", container, "perl", "-MIO::Socket::INET", "-e", probe],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return done.returncode == 0


def test_a_partition_between_the_zones_leaves_each_zone_serving_on_its_own(
    compose_mesh: str,
) -> None:
    """Each zone's Envoy cut off from the other zone's network (`docker network disconnect`,
    the only path between the zones in deploy/compose/dns.yml) under load, then joined
    again: the cut is real (a zone's Envoy no longer reaches the other zone's model server,
    and does again after), both zones go on answering from their own replicas, and no call
    fails."""
    from tests.waiting import wait_until

    envoys = {zone: container_of(f"envoy-{zone}") for zone in ("zone-a", "zone-b")}
    other = {"zone-a": "zone-b", "zone-b": "zone-a"}
    model_port = {"zone-a": 50052, "zone-b": 50053}  # deploy/compose/mesh-dns.yaml, resolved

    def across(zone: str) -> str:
        return f"model-fraud-{other[zone]}-0:{model_port[other[zone]]}"

    assert all(reaches(envoys[z], across(z)) for z in envoys)  # the check can fail below
    with edge_load(EDGE_PORT) as load:
        cut_at = load.now_s()
        for zone, envoy in envoys.items():
            subprocess.run(["docker", "network", "disconnect", f"{PROJECT}_{other[zone]}",
                            envoy], check=True, timeout=60)  # fmt: skip
        try:
            cut = {zone: not reaches(envoy, across(zone)) for zone, envoy in envoys.items()}
            wait_until(lambda: sum(o.sent_s > cut_at for o in load.outcomes) >= 100,
                       "100 calls across the partition", timeout_s=120)  # fmt: skip
        finally:
            for zone, envoy in envoys.items():
                rejoin = ["docker", "network", "connect", "--alias", f"envoy-{zone}"]
                subprocess.run([*rejoin, f"{PROJECT}_{other[zone]}", envoy], check=True, timeout=60)
        healed_at = load.now_s()
        answers_after(load, healed_at, "answers after the heal")
    outcomes, failed = failures(load)
    during = [o for o in outcomes if cut_at <= o.sent_s < healed_at]
    served = sorted({o.zone for o in during if o.ok})
    print(f"{len(outcomes)} calls ({len(during)} across the partition, answered from "
          f"{served}), {len(failed)} failed: {failed[:10]}")  # fmt: skip
    assert cut == {"zone-a": True, "zone-b": True}, cut
    assert all(reaches(envoys[z], across(z)) for z in envoys)  # joined again
    assert not load.error, load.error
    assert len(during) >= 100 and served == ["zone-a", "zone-b"]
    assert failed == [], failed[:10]


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
