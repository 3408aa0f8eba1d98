"""Zones in their own network namespaces, and partitions between them.

`ZoneNetwork` gives each zone a network namespace with one veth into a bridge that lives in
a namespace of its own (the "core"); every zone address is private to namespaces this code
created. `attach_host` adds one more veth from the machine into that bridge, so that a mesh
whose zone services run inside the namespaces keeps its loopback addressing (the launcher
does this for a spec with `network: {mode: netns}`): NAT rules in chains of their own carry
127.0.0.1:<port> across, and `zone_source_address` is the loopback address Envoy's
clusters for a zone send from, which the zones see as that zone's address.
`partition(a, b)` drops every packet between two zones with iptables (or nftables) rules
inside both zones' namespaces; `heal()` removes exactly those rules; `close()` removes the
chains, the link and the namespaces. tc netem is not available on this kernel, so there is
no latency or random loss here: only clean drops.

Needs root, iproute2 and iptables or nft (`apt-get install iptables`). `available()` says
whether this machine can, and why not.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field


class NetnsError(RuntimeError):
    """A namespace, link or rule could not be created or removed."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def zone_source_address(zone_index: int) -> str:
    """The loopback address a local client (Envoy's clusters for a zone) binds to speak for
    the zone at `zone_index` in the spec; attach_host maps it to that zone's egress address."""
    return f"127.0.{zone_index + 1}.1"


def firewall() -> str | None:
    """'iptables' or 'nft', whichever is installed (iptables first)."""
    if shutil.which("iptables"):
        return "iptables"
    if shutil.which("nft"):
        return "nft"
    return None


def _free_subnet() -> str:
    """A 10.213.<n> prefix that no address on the machine uses yet."""
    used = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    candidates = list(range(1, 255))
    random.shuffle(candidates)
    for n in candidates:
        if f" 10.213.{n}." not in used:
            return f"10.213.{n}"
    raise NetnsError("no free 10.213.x.0/24 subnet left")


def available() -> tuple[bool, str]:
    """Whether zones can run in namespaces here, and if not, why."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if not shutil.which("ip"):
        return False, "iproute2 (`ip`) is not installed"
    if firewall() is None:
        return False, "neither iptables nor nft is installed (apt-get install iptables)"
    probe = f"smprobe-{uuid.uuid4().hex[:6]}"
    done = _run(["ip", "netns", "add", probe], check=False)
    if done.returncode != 0:
        return False, f"cannot create a network namespace: {done.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return True, ""


@dataclass
class ZoneNetwork:
    zones: list[str]
    # 10.213.x.0/24 addresses exist only on links this network creates; each network picks
    # a /24 no interface of the machine uses, so two drills at once do not collide.
    subnet: str = field(default_factory=lambda: _free_subnet())
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    _rules: list[tuple[str, list[str]]] = field(default_factory=list)
    _created: list[str] = field(default_factory=list)
    _host_link: str = ""
    _host_chains: list[tuple[str, str]] = field(default_factory=list)  # (builtin, ours)

    @property
    def core(self) -> str:
        return f"smz{self.tag}-core"

    def namespace(self, zone: str) -> str:
        return f"smz{self.tag}-{self.zones.index(zone)}"

    def address(self, zone: str) -> str:
        return f"{self.subnet}.{10 + self.zones.index(zone)}"

    @property
    def gateway(self) -> str:
        """The machine's side of the bridge (only with attach_host)."""
        return f"{self.subnet}.1"

    def egress(self, zone: str) -> str:
        """The address the machine's side uses for traffic it sends on behalf of `zone`."""
        return f"{self.subnet}.{2 + self.zones.index(zone)}"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this network creates (whether or not it exists right now)."""
        return [self.core, *(self.namespace(z) for z in self.zones)]

    @property
    def nat_chains(self) -> list[str]:
        """The iptables NAT chains attach_host creates."""
        return [f"SMZ{self.tag}-{b[:4]}" for b in ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")]

    def exec_argv(self, zone: str, argv: list[str]) -> list[str]:
        """argv run inside the zone's namespace."""
        return ["ip", "netns", "exec", self.namespace(zone), *argv]

    # --- lifecycle -------------------------------------------------------------------------

    def create(self) -> ZoneNetwork:
        try:
            self._add_namespace(self.core)
            _run(["ip", "-n", self.core, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.core, "link", "set", "br0", "up"])
            for index, zone in enumerate(self.zones):
                ns = self.namespace(zone)
                self._add_namespace(ns)
                inside, outside = f"smz{self.tag}{index}a", f"smz{self.tag}{index}b"
                # The pair is made inside the zone's namespace, its far end moved to the core.
                _run(["ip", "-n", ns, "link", "add", inside, "type", "veth", "peer", outside])
                _run(["ip", "-n", ns, "link", "set", outside, "netns", self.core])
                _run(["ip", "-n", self.core, "link", "set", outside, "master", "br0", "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.address(zone)}/24", "dev", inside])
                _run(["ip", "-n", ns, "link", "set", inside, "up"])
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def close(self) -> None:
        """Remove the rules and every namespace (their links and addresses go with them)."""
        try:
            self.heal()
        finally:
            for builtin, chain in reversed(self._host_chains):
                _run(["iptables", "-t", "nat", "-D", builtin, "-j", chain], check=False)
                _run(["iptables", "-t", "nat", "-F", chain], check=False)
                _run(["iptables", "-t", "nat", "-X", chain], check=False)
            self._host_chains.clear()
            if self._host_link:
                _run(["ip", "link", "del", self._host_link], check=False)
                self._host_link = ""
            for name in reversed(self._created):
                _run(["ip", "netns", "del", name], check=False)
            self._created.clear()

    def __enter__(self) -> ZoneNetwork:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- joining the machine's loopback ------------------------------------------------------

    def attach_host(self, zone_ports: dict[str, list[int]], host_ports: list[int]) -> None:
        """Let processes on the machine and in the zones keep using 127.0.0.1 as they do.

        Services inside a zone bind the zone namespace's loopback; a connection from the
        machine to 127.0.0.1:<port of a zone's service> is sent across the bridge to that
        zone (NAT), and a connection from inside a zone to 127.0.0.1:<one of host_ports>
        (Envoy's listeners, the registry, Redis) is sent to the machine. A client on the
        machine bound to zone_source_address(i) is seen by the zones as egress(zone i), so
        rules inside a zone can tell which zone a proxied connection speaks for.
        Needs iptables (NAT); the rules live in chains of their own, removed by close().
        """
        if firewall() != "iptables":
            raise NetnsError("joining the zones to the machine's loopback needs iptables")
        host, far = f"smz{self.tag}h", f"smz{self.tag}c"
        _run(["ip", "link", "add", host, "type", "veth", "peer", far])
        self._host_link = host
        _run(["ip", "link", "set", far, "netns", self.core])
        _run(["ip", "-n", self.core, "link", "set", far, "master", "br0", "up"])
        _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", host])
        for zone in self.zones:
            _run(["ip", "addr", "add", f"{self.egress(zone)}/32", "dev", host])
        _run(["ip", "link", "set", host, "up"])
        # 127.0.0.0/8 may leave (and arrive) through these links only because of this.
        _run(["sysctl", "-qw", f"net.ipv4.conf.{host}.route_localnet=1"])
        builtins = ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")
        chains = dict(zip(builtins, self.nat_chains, strict=True))
        for builtin, chain in chains.items():
            _run(["iptables", "-t", "nat", "-N", chain])
            _run(["iptables", "-t", "nat", "-I", builtin, "-j", chain])
            self._host_chains.append((builtin, chain))

        def nat(chain: str, *spec: str) -> None:
            _run(["iptables", "-t", "nat", "-A", chain, *spec])

        nat(chains["PREROUTING"], "-i", host, "-d", self.gateway, "-j", "DNAT",
            "--to-destination", "127.0.0.1")  # fmt: skip
        # ... and arrives from 127.0.0.1, as the machine's services expect of local callers
        # (Redis refuses other sources in protected mode).
        nat(chains["INPUT"], "-i", host, "-d", "127.0.0.1", "-j", "SNAT",
            "--to-source", "127.0.0.1")  # fmt: skip
        for zone, ports in zone_ports.items():
            for port in ports:
                nat(chains["OUTPUT"], "-d", "127.0.0.1", "-p", "tcp", "--dport", str(port),
                    "-j", "DNAT", "--to-destination", self.address(zone))  # fmt: skip
        for index, zone in enumerate(self.zones):
            nat(chains["POSTROUTING"], "-o", host, "-s", zone_source_address(index),
                "-j", "SNAT", "--to-source", self.egress(zone))  # fmt: skip
        nat(chains["POSTROUTING"], "-o", host, "-s", "127.0.0.0/8", "-j", "SNAT",
            "--to-source", self.gateway)  # fmt: skip
        for index, zone in enumerate(self.zones):
            ns, link = self.namespace(zone), f"smz{self.tag}{index}a"
            inside = ["ip", "netns", "exec", ns]
            _run([*inside, "sysctl", "-qw", f"net.ipv4.conf.{link}.route_localnet=1"])
            _run([*inside, "iptables", "-t", "nat", "-A", "PREROUTING", "-d",
                  self.address(zone), "-j", "DNAT", "--to-destination", "127.0.0.1"])  # fmt: skip
            for start in range(0, len(host_ports), 15):  # multiport takes 15 ports at most
                chunk = ",".join(str(p) for p in host_ports[start : start + 15])
                _run([*inside, "iptables", "-t", "nat", "-A", "OUTPUT", "-d", "127.0.0.1",
                      "-p", "tcp", "-m", "multiport", "--dports", chunk, "-j", "DNAT",
                      "--to-destination", self.gateway])  # fmt: skip
            _run([*inside, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", link, "-s",
                  "127.0.0.0/8", "-j", "SNAT", "--to-source", self.address(zone)])  # fmt: skip

    # --- partitions ------------------------------------------------------------------------

    def partition(self, zone_a: str, zone_b: str) -> list[str]:
        """Drop all packets between the two zones, by rules inside both namespaces."""
        if zone_a == zone_b:
            raise NetnsError("a partition needs two different zones")
        added = []
        for here, there in ((zone_a, zone_b), (zone_b, zone_a)):
            ns = self.namespace(here)
            # The other zone's own address, and (when joined to the machine) the address the
            # machine's proxy uses when it speaks for the other zone.
            peers = [self.address(there)] + ([self.egress(there)] if self._host_link else [])
            peer = ",".join(peers)
            if firewall() == "iptables":
                specs = [["INPUT", "-s", peer, "-j", "DROP"], ["OUTPUT", "-d", peer, "-j", "DROP"]]
                for spec in specs:
                    _run(["ip", "netns", "exec", ns, "iptables", "-I", *spec])
                    self._rules.append((ns, ["iptables", "-D", *spec]))
                    added.append(f"{ns}: iptables -I {' '.join(spec)}")
            else:
                table = f"servemesh_{self.tag}"
                script = (
                    f"add table inet {table}\n"
                    f"add chain inet {table} in {{ type filter hook input priority 0; }}\n"
                    f"add chain inet {table} out {{ type filter hook output priority 0; }}\n"
                    f"add rule inet {table} in ip saddr {{ {peer} }} drop\n"
                    f"add rule inet {table} out ip daddr {{ {peer} }} drop\n"
                )
                done = subprocess.run(
                    ["ip", "netns", "exec", ns, "nft", "-f", "-"],
                    input=script,
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                if done.returncode != 0:
                    raise NetnsError(f"nft in {ns}: {done.stderr.strip()}")
                self._rules.append((ns, ["nft", "delete", "table", "inet", table]))
                added.append(f"{ns}: nft table inet {table} drops {peer}")
        return added

    def heal(self) -> list[str]:
        removed = []
        while self._rules:
            ns, undo = self._rules.pop()
            _run(["ip", "netns", "exec", ns, *undo], check=False)
            removed.append(f"{ns}: {' '.join(undo)}")
        return removed

    @property
    def partitioned(self) -> bool:
        return bool(self._rules)
