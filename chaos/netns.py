"""Zones in their own network namespaces, and partitions between them.

`ZoneNetwork` gives each zone a network namespace with one veth into a bridge that lives in
a namespace of its own (the "core"), so nothing is added to the machine's own network: every
address is private to namespaces this code created, and removing the namespaces removes it
all. `partition(a, b)` drops every packet between two zones with iptables (or nftables)
rules inside both zones' namespaces; `heal()` removes exactly those rules. tc netem is not
available on this kernel, so there is no latency or random loss here: only clean drops.

Needs root, iproute2 and iptables or nft (`apt-get install iptables`). `available()` says
whether this machine can, and why not.
"""

from __future__ import annotations

import os
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


def firewall() -> str | None:
    """'iptables' or 'nft', whichever is installed (iptables first)."""
    if shutil.which("iptables"):
        return "iptables"
    if shutil.which("nft"):
        return "nft"
    return None


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
    # 10.x addresses exist only inside the namespaces below; nothing routes them elsewhere.
    subnet: str = "10.213.0"
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    _rules: list[tuple[str, list[str]]] = field(default_factory=list)
    _created: list[str] = field(default_factory=list)

    @property
    def core(self) -> str:
        return f"smz{self.tag}-core"

    def namespace(self, zone: str) -> str:
        return f"smz{self.tag}-{self.zones.index(zone)}"

    def address(self, zone: str) -> str:
        return f"{self.subnet}.{10 + self.zones.index(zone)}"

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
            for name in reversed(self._created):
                _run(["ip", "netns", "del", name], check=False)
            self._created.clear()

    def __enter__(self) -> ZoneNetwork:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- partitions ------------------------------------------------------------------------

    def partition(self, zone_a: str, zone_b: str) -> list[str]:
        """Drop all packets between the two zones, by rules inside both namespaces."""
        if zone_a == zone_b:
            raise NetnsError("a partition needs two different zones")
        added = []
        for here, there in ((zone_a, zone_b), (zone_b, zone_a)):
            ns, peer = self.namespace(here), self.address(there)
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
                    f"add rule inet {table} in ip saddr {peer} drop\n"
                    f"add rule inet {table} out ip daddr {peer} drop\n"
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
