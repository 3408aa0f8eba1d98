"""Partitions between zones in network namespaces (root, iproute2, iptables).

The namespace layer on its own (two zone namespaces joined by a bridge in a third, a server
in each, traffic between them dropped by the partition and back after the heal), then the
inter-zone-partition drill against a mesh whose zones' services run in those namespaces,
and that drill, sent SIGTERM mid-partition, removing every namespace, link and chain of its
own.
Skipped, with the reason, where this machine cannot (not root, no iptables).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.procs import Check, Supervisor
from servemesh.procs.netns import ZoneNetwork, available
from tests.netns.helpers import owned_by

CAN, WHY = available()
needs_netns = pytest.mark.skipif(not CAN, reason=f"zone namespaces unavailable here: {WHY}")

SERVE = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], 7000)); s.listen(16); print('ready', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(b'hi'); c.close()\n"
)
CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    with socket.create_connection((sys.argv[1], 7000), timeout=1) as c:\n"
    "        sys.exit(0 if c.recv(2) == b'hi' else 1)\n"
    "except OSError:\n"
    "    sys.exit(2)\n"
)


def said_ready(log: Path) -> Check:
    """Ready once the server printed that it listens."""
    return Check(lambda: "ready" in log.read_text(), f"{log.stem} listening")


@pytest.fixture
def network(tmp_path: Path) -> Iterator[ZoneNetwork]:
    net = ZoneNetwork(["zone-a", "zone-b"]).create()
    try:
        with Supervisor(tmp_path) as servers:
            for zone in net.zones:
                argv = net.exec_argv(zone, [sys.executable, "-c", SERVE, net.address(zone)])
                servers.start(zone, argv, ready=said_ready(tmp_path / f"{zone}.log"), timeout_s=30)
            yield net
    finally:
        net.close()


def reaches(net: ZoneNetwork, source: str, target: str) -> bool:
    argv = net.exec_argv(source, [sys.executable, "-c", CONNECT, net.address(target)])
    return subprocess.run(argv, timeout=10).returncode == 0


@needs_netns
def test_a_partition_drops_traffic_between_zones_only_and_heals(network: ZoneNetwork) -> None:
    assert reaches(network, "zone-a", "zone-b") and reaches(network, "zone-b", "zone-a")
    rules = network.partition("zone-a", "zone-b")
    assert len(rules) >= 2
    assert not reaches(network, "zone-a", "zone-b")
    assert not reaches(network, "zone-b", "zone-a")
    # Inside each zone, traffic still flows.
    assert reaches(network, "zone-a", "zone-a") and reaches(network, "zone-b", "zone-b")
    network.heal()
    assert not network.partitioned
    assert reaches(network, "zone-a", "zone-b") and reaches(network, "zone-b", "zone-a")


@needs_netns
def test_closing_the_network_leaves_no_namespace_behind() -> None:
    net = ZoneNetwork(["zone-a", "zone-b"]).create()
    names = [net.core, *(net.namespace(z) for z in net.zones)]
    net.partition("zone-a", "zone-b")
    net.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in listed]


@needs_netns
@pytest.mark.mesh
def test_inter_zone_partition_drill_each_zone_serves_alone(tmp_path: Path) -> None:
    from tests.chaos.test_drills import drill, explained, method_output

    result = drill("inter-zone-partition", tmp_path)
    assert result.verdict == "held", explained(result)
    (cut,) = result.summary["windows"]
    assert cut["label"] == "partition zone-a / zone-b"
    assert cut["success_pct"] >= 99.5 and cut["degraded"] == 0, cut
    # Each zone kept serving from its own replicas ...
    assert min(cut["zones"].get(z, 0) for z in ("zone-a", "zone-b")) > 30, cut["zones"]
    # ... while zone-a's Envoy clusters could not reach zone-b's replicas at all.
    assert method_output(result, "zone-b-models-healthy-seen-from-zone-a-during") == 0
    # Healed: the drill waited for zone-a's Envoy to hold zone-b's replicas healthy again,
    # and the steady state after checks it.
    again = method_output(result, "zone-b-models-healthy-again-from-zone-a")
    assert again["in_time"] is True and again["healthy"] >= 1, again
    after = {p["name"]: p for p in result.summary["steady_state"]["after"]["probes"]}
    assert after["zone-b-models-healthy-seen-from-zone-a"]["value"] >= 1
    # Nothing of the drill's network is left: none of its namespaces, none of its chains.
    network = result.summary["network"]
    assert network["mode"] == "netns"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in network["namespaces"] if n in listed]
    nat = subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True).stdout
    assert not [c for c in network["nat_chains"] if c in nat]


def _partitioned(pid: int) -> bool:
    """The drill of process `pid` holds its partition: DROP rules in its zone-a namespace."""
    names = [n for n in owned_by(pid) if n.endswith("-zone-a")]
    if not names:
        return False
    argv = ["ip", "netns", "exec", names[0], "iptables", "-w", "5", "-S"]
    listed = subprocess.run(argv, capture_output=True, text=True).stdout
    return "-j DROP" in listed


@needs_netns
@pytest.mark.mesh
def test_a_drill_sent_sigterm_mid_partition_removes_its_network(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "servemesh", "chaos", "run", "inter-zone-partition",
            "--quiet", "--out", str(tmp_path / "run"), "--var", "fault_s=300"]  # fmt: skip
    with Supervisor(tmp_path / "logs") as supervisor:
        # Ready once the partition holds: the fault window lasts far longer than the test.
        held = Check(lambda: _partitioned(supervisor.pid("drill")), "the partition holds")
        drill = supervisor.start("drill", argv, ready=held, timeout_s=240)
        assert len(owned_by(drill.pid)) == 3 + 1 + 5
        supervisor.send_signal("drill", signal.SIGTERM)
        drill.wait(120)
        assert "SIGTERM" in drill.log_tail()
    assert owned_by(drill.pid) == []
