"""The zones' network lets through the mesh's own ports and addresses, nothing else.

Two zone namespaces joined to the machine as the launcher joins them: a server in each
zone on its service port, a "mesh" server on the machine on the one port the zones may
call, and two machine servers on ports the mesh does not use (one on loopback, one on
every address). Every NAT rule must name tcp, a port of the mesh and an address of the
network; a zone reaches its allowed port and nothing else on the machine. The zones'
processes run without any capability.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from servemesh.procs import Supervisor
from servemesh.procs.netns import NETNS_DIR, ZoneNetwork, zone_source_address
from servemesh.procs.sandbox import AUTO_GID, AUTO_UID, RunAs
from tests.netns.helpers import (
    CONNECT,
    SERVE,
    capabilities,
    chains,
    free_port,
    needs_netns,
    said_ready,
)
from tests.waiting import wait_until

ZONES = ["zone-a", "zone-b"]


@dataclass
class Joined:
    net: ZoneNetwork
    zone_ports: dict[str, int]
    host_port: int
    unused_loopback: int
    unused_any: int
    pids: dict[str, int]

    @property
    def mesh_ports(self) -> set[int]:
        return {*self.zone_ports.values(), self.host_port}

    @property
    def addresses(self) -> set[str]:
        net = self.net
        return {
            "127.0.0.1",
            net.gateway,
            *(net.address(z) for z in net.zones),
            *(net.egress(z) for z in net.zones),
            *(zone_source_address(i) for i in range(len(net.zones))),
        }


def sysctl(name: str) -> str:
    return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True).stdout.strip()


LOCALNET = [f"net.ipv4.conf.{i}.route_localnet" for i in ("all", "default", "lo")]


@pytest.fixture
def joined(tmp_path: Path) -> Iterator[Joined]:
    zone_ports = {zone: free_port() for zone in ZONES}
    host_port, unused_loopback, unused_any = free_port(), free_port(), free_port()
    net = ZoneNetwork(list(ZONES)).create()
    try:
        with Supervisor(tmp_path) as servers:
            machine = [("host", "127.0.0.1", host_port), ("unused-lo", "127.0.0.1",
                       unused_loopback), ("unused-any", "0.0.0.0", unused_any)]  # fmt: skip
            for name, address, port in machine:
                argv = [sys.executable, "-c", SERVE, address, str(port), name]
                servers.start(name, argv, ready=said_ready(tmp_path / f"{name}.log"))
            for zone, port in zone_ports.items():
                argv = net.exec_argv(zone, [sys.executable, "-c", SERVE, "127.0.0.1", str(port),
                                            zone])  # fmt: skip
                servers.start(zone, argv, ready=said_ready(tmp_path / f"{zone}.log"))
            net.attach_host(
                {zone: [port] for zone, port in zone_ports.items()},
                {zone: [host_port] for zone in ZONES},
            )
            yield Joined(net, zone_ports, host_port, unused_loopback, unused_any,
                         servers.pids())  # fmt: skip
    finally:
        net.close()


def answer(argv: list[str]) -> str:
    """What the server said, or the error's name."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    return done.stdout.strip()


def from_zone(j: Joined, zone: str, host: str, port: int) -> str:
    return answer(j.net.exec_argv(zone, [sys.executable, "-c", CONNECT, host, str(port)]))


def from_machine(host: str, port: int) -> str:
    return answer([sys.executable, "-c", CONNECT, host, str(port)])


def rules(table: str, chain: str | None = None, netns: str | None = None) -> list[list[str]]:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    argv = [*prefix, "iptables", "-w", "5", "-t", table, "-S", *([chain] if chain else [])]
    listed = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return [line.split() for line in listed.splitlines() if line.startswith("-A ")]


def value_after(rule: list[str], *flags: str) -> list[str]:
    return [rule[i + 1] for i, word in enumerate(rule[:-1]) if word in flags]


def assert_scoped(rule: list[str], j: Joined) -> None:
    """tcp, ports of the mesh only, addresses of the network only."""
    text = " ".join(rule)
    assert value_after(rule, "-p") == ["tcp"], text
    ports = {int(p) for v in value_after(rule, "--dports", "--dport") for p in v.split(",")}
    assert ports and ports <= j.mesh_ports, text
    addresses = value_after(rule, "-s", "-d", "--to-destination", "--to-source")
    assert addresses, text
    for address in addresses:
        assert address.removesuffix("/32") in j.addresses, text


@needs_netns
def test_every_nat_rule_names_tcp_a_mesh_port_and_an_address_of_the_network(
    joined: Joined,
) -> None:
    net = joined.net
    on_machine = [rule for chain in net.nat_chains for rule in rules("nat", chain)]
    # The machine's chains: into each zone (OUTPUT, POSTROUTING) and out of each (the rest).
    assert {r[1] for r in on_machine} == set(net.nat_chains)
    for rule in on_machine:
        assert_scoped(rule, joined)
    for zone in net.zones:
        inside = rules("nat", netns=net.namespace(zone))
        assert {r[1] for r in inside} == {"PREROUTING", "OUTPUT", "POSTROUTING"}
        for rule in inside:
            assert_scoped(rule, joined)
    # Whatever else a zone sends the machine's side of the bridge is dropped.
    flt = rules("filter", net.filter_chain)
    assert flt[-1] == ["-A", net.filter_chain, "-i", net.host_link, "-j", "DROP"]
    for rule in flt[:-2]:
        assert_scoped(rule, joined)
    # Jumps into our chains, and nothing else of ours, in the built-in chains.
    assert ["-A", "INPUT", "-i", net.host_link, "-j", net.filter_chain] in rules("filter")


# 13 s of probing every port from inside a zone: the whole suite runs it, not the fast lane.
@pytest.mark.slow
@needs_netns
def test_a_zone_reaches_the_meshs_ports_and_no_other_port_of_the_machine(
    joined: Joined,
) -> None:
    net = joined.net
    for zone, port in joined.zone_ports.items():
        # The machine reaches each zone's service at its loopback port ...
        assert from_machine("127.0.0.1", port) == zone
        # ... and each zone the machine's mesh port, at its own loopback.
        assert from_zone(joined, zone, "127.0.0.1", joined.host_port) == "host"
        # The machine's servers on other ports answer on the machine ...
        assert from_machine("127.0.0.1", joined.unused_loopback) == "unused-lo"
        assert from_machine("127.0.0.1", joined.unused_any) == "unused-any"
        # ... but not to a zone: not at its loopback, not at the bridge's machine side.
        for port in (joined.unused_loopback, joined.unused_any):
            assert from_zone(joined, zone, "127.0.0.1", port) == "ConnectionRefusedError"
            assert from_zone(joined, zone, net.gateway, port) in ("TimeoutError", "timeout")
        # Nor another zone's service port, which leads into that zone from the machine only.
        other = next(z for z in net.zones if z != zone)
        assert from_zone(joined, zone, "127.0.0.1", joined.zone_ports[other]) == (
            "ConnectionRefusedError"
        )


@needs_netns
def test_route_localnet_is_set_on_the_bridge_link_only_and_goes_with_it(tmp_path: Path) -> None:
    before = [sysctl(name) for name in LOCALNET]
    net = ZoneNetwork(list(ZONES)).create()
    try:
        net.attach_host({"zone-a": [free_port()]}, {"zone-a": [free_port()]})
        assert sysctl(f"net.ipv4.conf.{net.host_link}.route_localnet") == "1"
        assert [sysctl(name) for name in LOCALNET] == before
    finally:
        net.close()
    assert [sysctl(name) for name in LOCALNET] == before
    ours = f"SM{net.pid}-{net.tag}-"
    assert not [c for c in chains("nat") + chains("filter") if c.startswith(ours)]


@needs_netns
def test_zone_processes_run_without_capabilities(joined: Joined) -> None:
    for zone in ZONES:
        caps = capabilities(joined.pids[zone])
        assert caps["Uid"] == "0"
        zero = "0000000000000000"
        assert {k: v for k, v in caps.items() if k.startswith("Cap")} == {
            "CapInh": zero, "CapPrm": zero, "CapEff": zero, "CapBnd": zero, "CapAmb": zero,
        }  # fmt: skip
        assert caps["NoNewPrivs"] == "1"
    # Without CAP_NET_ADMIN a zone's process cannot undo the rules it sits behind.
    argv = joined.net.exec_argv("zone-a", ["iptables", "-t", "nat", "-F"])
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "Permission denied" in refused.stderr
    assert rules("nat", netns=joined.net.namespace("zone-a"))


@needs_netns
def test_zone_processes_can_run_as_an_unprivileged_user(tmp_path: Path) -> None:
    port = free_port()
    net = ZoneNetwork(["zone-a"], run_as="nobody").create()
    try:
        with Supervisor(tmp_path) as servers:
            argv = net.exec_argv("zone-a", [sys.executable, "-c", SERVE, net.address("zone-a"),
                                            str(port), "zone-a"])  # fmt: skip
            servers.start("zone-a", argv, ready=said_ready(tmp_path / "zone-a.log"))
            caps = capabilities(servers.pid("zone-a"))
            assert caps["Uid"] == "65534" and caps["CapEff"] == "0000000000000000"
            probe = net.exec_argv("zone-a", [sys.executable, "-c", CONNECT,
                                             net.address("zone-a"), str(port)])  # fmt: skip
            assert answer(probe) == "zone-a"
    finally:
        net.close()


# Starts argv (JSON), waits for it to say ready, prints its pid, then waits for it.
_PARENT = (
    "import json, subprocess, sys\n"
    "child = subprocess.Popen(json.loads(sys.argv[1]), stdout=subprocess.PIPE, text=True)\n"
    "assert child.stdout is not None and child.stdout.readline().strip() == 'ready'\n"
    "print(child.pid, flush=True)\n"
    "child.wait()\n"
)


def _running(pid: int) -> bool:
    """Whether pid is a live process (a zombie waiting for init's reaping is not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


@needs_netns
def test_a_zone_process_run_as_a_sandbox_user_changes_user_without_caps_and_dies_with_its_parent(
    tmp_path: Path,
) -> None:
    # A model server in a zone namespace: `ip netns exec` needs root, so the change of user
    # happens inside the namespace, and the parent-death signal is set after it.
    net = ZoneNetwork(["zone-a"]).create()
    child = 0
    try:
        argv = net.exec_argv(
            "zone-a",
            [sys.executable, "-c", SERVE, net.address("zone-a"), str(free_port()), "zone-a"],
            run_as=RunAs(AUTO_UID, AUTO_GID),
            death_signal=signal.SIGTERM,
        )
        with subprocess.Popen(
            [sys.executable, "-c", _PARENT, json.dumps(argv)], stdout=subprocess.PIPE, text=True
        ) as parent:
            try:
                assert parent.stdout is not None
                child = int(parent.stdout.readline())
                caps = capabilities(child)
                assert caps["Uid"] == str(AUTO_UID)
                assert caps["CapEff"] == caps["CapBnd"] == "0000000000000000"
                assert caps["NoNewPrivs"] == "1"
                inside = os.stat(NETNS_DIR / net.namespace("zone-a")).st_ino
                assert os.stat(f"/proc/{child}/ns/net").st_ino == inside
            finally:
                parent.kill()
        wait_until(lambda: not _running(child), "the child stopped with its parent")
    finally:
        if child and _running(child):
            os.kill(child, signal.SIGKILL)
        net.close()
