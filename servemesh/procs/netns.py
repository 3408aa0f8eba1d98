"""Zones in their own network namespaces, and partitions between them.

`ZoneNetwork` gives each zone a network namespace with one veth into a bridge that lives in
a namespace of its own (the "core"); every zone address is private to namespaces this code
created. `attach_host` adds one more veth from the machine into that bridge, so that a mesh
whose zone services run inside the namespaces keeps its loopback addressing (the launcher
does this for a spec with `network: {mode: netns}`): NAT rules in chains of their own carry
127.0.0.1:<port> across, and `zone_source_address` is the loopback address Envoy's
clusters for a zone send from, which the zones see as that zone's address. With an Envoy
per zone, each runs inside its zone instead, and `join_zones` lets it reach the other
zones' replicas at 127.0.0.1 straight across the bridge.
`partition(a, b)` drops every packet between two zones with iptables (or nftables) rules
inside both zones' namespaces; `heal()` removes exactly those rules; `close()` removes the
chains, the link and the namespaces. tc netem is not available on this kernel, so there is
no latency or random loss here: only clean drops.

Scoped to the mesh (docs/security.md, "Zones in network namespaces"):

- every NAT rule names tcp, the exact ports the mesh uses and the exact addresses of its
  network; the machine's side of the bridge drops whatever else a zone sends it;
- every namespace, link and chain is named after the process that owns it
  (`sm<pid>-<tag>...`, `SM<pid>-<tag>-...`), so `sweep_leftovers()` (run by `create()`)
  removes what a killed process left behind and never touches a live one's;
- `exec_argv` runs a zone's processes without any capability (no CAP_NET_ADMIN: they
  cannot change the rules or the links they sit behind), optionally as another user.

Needs root, iproute2 and iptables or nft (`apt-get install iptables`). `available()` says
whether this machine can, and why not.
"""

from __future__ import annotations

import atexit
import os
import random
import re
import shutil
import signal
import string
import subprocess
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from servemesh.contract.errors import ServemeshError
from servemesh.procs.sandbox import RunAs


class NetnsError(ServemeshError, RuntimeError):
    """A namespace, link or rule could not be created or removed."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def _iptables(*args: str, netns: str | None = None, check: bool = True) -> None:
    """iptables, waiting for the xtables lock: several meshes change rules at once."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    _run([*prefix, "iptables", "-w", "5", *args], check=check)


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


# --- names: the owner's PID and a tag ----------------------------------------------------------
#
# A network of process 4242 with tag "qk" owns namespaces sm4242-qk_core and
# sm4242-qk-<zone>, links sm4242-qk<i>a/b (zones) and sm4242-qkh/c (the machine's), and the
# chains SM4242-qk-PRE, -IN, -OUT, -POST (nat) and SM4242-qk-FLT (filter). The tag is two
# letters, so the PID's digits end where it begins; a zone name cannot hold "_", so the
# core's name never equals a zone's. Linux caps link names at 15 characters (pid_max is at
# most 4194304: 7 digits) and iptables chain names at 28.
IFNAME_MAX = 15
CHAIN_MAX = 28
_NAME = re.compile(r"^sm(?P<pid>\d+)-(?P<tag>[a-z]{2})(?:[-_].*|[0-9]+[ab]|[hc])$")
_CHAIN = re.compile(r"^SM(?P<pid>\d+)-(?P<tag>[a-z]{2})-[A-Z]+$")
NAT_CHAINS = {"PREROUTING": "PRE", "INPUT": "IN", "OUTPUT": "OUT", "POSTROUTING": "POST"}
FILTER_CHAIN = "FLT"
NETNS_DIR = Path("/run/netns")

# The networks this process has created and not closed yet, by tag: the sweep leaves them
# alone even when an earlier process with this same PID left some behind.
_open: dict[str, ZoneNetwork] = {}


@atexit.register
def _close_open_networks() -> None:
    """An interpreter that exits without closing its networks (an uncaught exception,
    sys.exit) still removes them."""
    for network in list(_open.values()):
        # A forked child inherits the table; only the process that made a network closes it.
        if network.pid == os.getpid():
            network.close()


def _start_time(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), None when it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return None
    # Field 22, after the command name in parentheses (which may hold spaces).
    ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _looks_like_owner(pid: int) -> bool:
    """A process that could own a network: Python (servemesh, its tests, its drills)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return b"python" in cmdline or b"servemesh" in cmdline


@dataclass
class Leftovers:
    """What one network of a dead owner left behind (or what a sweep removed)."""

    pid: int
    tag: str
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    chains: list[tuple[str, str]] = field(default_factory=list)  # (table, chain)

    @property
    def created_at(self) -> float | None:
        """When its first namespace was made (the mtime of /run/netns/<name>)."""
        times = []
        for name in self.namespaces:
            try:
                times.append((NETNS_DIR / name).stat().st_mtime)
            except FileNotFoundError:
                continue
        return min(times) if times else None

    def owner_alive(self) -> bool:
        """Whether the process that made it still runs. A PID in use by a process that
        started after the network was made, or by something that is not Python, is a
        reused PID: the owner is gone."""
        if self.pid == os.getpid():
            return self.tag in _open
        started = _start_time(self.pid)
        if started is None:
            return False
        created = self.created_at
        # btime has one-second resolution: allow two.
        if created is not None and started > created + 2.0:
            return False
        return _looks_like_owner(self.pid)


def _list_names(argv: list[str]) -> list[str]:
    return _run(argv, check=False).stdout.splitlines()


def find_networks() -> dict[tuple[int, str], Leftovers]:
    """Every namespace, machine link and chain named by this module's scheme, by owner."""
    found: dict[tuple[int, str], Leftovers] = {}

    def entry(pid: str, tag: str) -> Leftovers:
        return found.setdefault((int(pid), tag), Leftovers(int(pid), tag))

    for line in _list_names(["ip", "netns", "list"]):
        name = line.split(" ", 1)[0]
        if m := _NAME.match(name):
            entry(m["pid"], m["tag"]).namespaces.append(name)
    for line in _list_names(["ip", "-o", "link", "show"]):
        # "7: sm4242-qkh@if6: <BROADCAST,...": the name ends at '@' or ':'.
        parts = line.split(": ", 2)
        if len(parts) < 2:
            continue
        name = parts[1].split("@", 1)[0]
        if m := _NAME.match(name):
            entry(m["pid"], m["tag"]).links.append(name)
    if shutil.which("iptables"):
        for table in ("nat", "filter"):
            for line in _list_names(["iptables", "-w", "5", "-t", table, "-S"]):
                if line.startswith("-N ") and (m := _CHAIN.match(line[3:].strip())):
                    entry(m["pid"], m["tag"]).chains.append((table, line[3:].strip()))
    return found


def _remove_chain(table: str, chain: str) -> None:
    """Remove every jump to `chain` from the built-in chains, then the chain itself."""
    rules = _list_names(["iptables", "-w", "5", "-t", table, "-S"])
    for rule in rules:
        words = rule.split()
        if words[:1] == ["-A"] and words[-2:] == ["-j", chain]:
            _iptables("-t", table, "-D", *words[1:], check=False)
    _iptables("-t", table, "-F", chain, check=False)
    _iptables("-t", table, "-X", chain, check=False)


def _remove(leftovers: Leftovers) -> None:
    for table, chain in leftovers.chains:
        _remove_chain(table, chain)
    for link in leftovers.links:
        _run(["ip", "link", "del", link], check=False)
    # The core last: the zones' veths end in it.
    for name in sorted(leftovers.namespaces, key=lambda n: n.endswith("_core")):
        _run(["ip", "netns", "del", name], check=False)


def sweep_leftovers() -> list[Leftovers]:
    """Remove the namespaces, links and chains of networks whose owner is dead (killed
    before it could close them); those of live processes stay. What was removed."""
    swept = [found for found in find_networks().values() if not found.owner_alive()]
    for leftovers in swept:
        _remove(leftovers)
    return swept


def _new_tag() -> str:
    """Two letters no open network of this process, nor a leftover with our PID, uses."""
    taken = set(_open) | {tag for pid, tag in find_networks() if pid == os.getpid()}
    while True:
        tag = "".join(random.choices(string.ascii_lowercase, k=2))
        if tag not in taken:
            return tag


def _chunks(ports: Iterable[int], size: int = 15) -> list[str]:
    """Ports as multiport lists (multiport takes 15 ports at most)."""
    ordered = sorted(set(ports))
    return [",".join(str(p) for p in ordered[i : i + size]) for i in range(0, len(ordered), size)]


def _tcp(ports: str) -> tuple[str, ...]:
    """An iptables match for tcp to the given ports (a multiport list, `_chunks`)."""
    return ("-p", "tcp", "-m", "multiport", "--dports", ports)


def drop_privileges_argv(
    run_as: str | RunAs | None = None, death_signal: signal.Signals | None = None
) -> list[str]:
    """The setpriv prefix that runs a command without any capability, unable to gain one
    (no_new_privs, an empty bounding set), as `run_as` (a user name or uid, or a RunAs) if
    given, else as the current user. Uid 0 without capabilities still reads the state dir's
    root-owned 0600 files (the control token, Redis's password), but cannot change links,
    routes or iptables rules, enter other namespaces, or trace other processes.

    The change of user happens here, in the setpriv that drops the capabilities: a later
    one would have no CAP_SETUID left to change it with. A change of user clears the
    parent-death signal, so `death_signal` (when given) is set again after it."""
    if not shutil.which("setpriv"):
        raise NetnsError("setpriv (util-linux) is not installed: cannot drop capabilities")
    argv = ["setpriv"]
    if run_as is not None:
        if isinstance(run_as, RunAs):
            uid, gid, groups = str(run_as.uid), run_as.gid, run_as.group_options()
        else:
            uid, gid, groups = run_as, _group_of(run_as), ["--clear-groups"]
        argv += [f"--reuid={uid}", f"--regid={gid}", *groups]
    if death_signal is not None:
        argv += ["--pdeathsig", death_signal.name.removeprefix("SIG")]
    return [*argv, "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all",
            "--no-new-privs", "--"]  # fmt: skip


def _group_of(user: str) -> int:
    import pwd

    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        raise NetnsError(f"run_as: no user {user!r} on this machine") from None
    return entry.pw_gid


@dataclass
class ZoneNetwork:
    zones: list[str]
    # 10.213.x.0/24 addresses exist only on links this network creates; each network picks
    # a /24 no interface of the machine uses, so two drills at once do not collide.
    subnet: str = field(default_factory=lambda: _free_subnet())
    # The user the zones' processes run as (exec_argv); None keeps the current one. Either
    # way they run without capabilities.
    run_as: str | None = None
    pid: int = field(default_factory=os.getpid)
    tag: str = field(default_factory=_new_tag)
    # What create() swept: networks of dead owners.
    swept: list[Leftovers] = field(default_factory=list)
    _rules: list[tuple[str, list[str]]] = field(default_factory=list)
    _created: list[str] = field(default_factory=list)
    _host_link: str = ""
    _host_chains: list[tuple[str, str]] = field(default_factory=list)  # (table, ours)

    def __post_init__(self) -> None:
        if len(self._link(len(self.zones) - 1, "a")) > IFNAME_MAX:
            raise NetnsError(f"{len(self.zones)} zones: link names would pass 15 characters")

    @property
    def prefix(self) -> str:
        return f"sm{self.pid}-{self.tag}"

    def _link(self, index: int, side: str) -> str:
        return f"{self.prefix}{index}{side}"

    @property
    def core(self) -> str:
        return f"{self.prefix}_core"

    def namespace(self, zone: str) -> str:
        self.zones.index(zone)  # ValueError for a zone not in this network
        return f"{self.prefix}-{zone}"

    def link(self, zone: str) -> str:
        """The zone's end of its veth (inside its namespace)."""
        return self._link(self.zones.index(zone), "a")

    @property
    def host_link(self) -> str:
        """The machine's end of the veth into the bridge (attach_host)."""
        return f"{self.prefix}h"

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
        return [f"SM{self.pid}-{self.tag}-{short}" for short in NAT_CHAINS.values()]

    @property
    def filter_chain(self) -> str:
        """The filter chain attach_host creates (what a zone may send the machine)."""
        return f"SM{self.pid}-{self.tag}-{FILTER_CHAIN}"

    def exec_argv(
        self,
        zone: str,
        argv: list[str],
        *,
        run_as: RunAs | None = None,
        death_signal: signal.Signals | None = None,
    ) -> list[str]:
        """argv run inside the zone's namespace, without capabilities, as `run_as` when
        given (a model server's own user), else as the network's run_as if set
        (`drop_privileges_argv`, which also says why `death_signal` is set there)."""
        drop = drop_privileges_argv(run_as if run_as is not None else self.run_as, death_signal)
        return ["ip", "netns", "exec", self.namespace(zone), *drop, *argv]

    # --- lifecycle -------------------------------------------------------------------------

    def create(self) -> ZoneNetwork:
        """Sweep what dead owners left, then make the core, the zones and their veths."""
        self.swept = sweep_leftovers()
        _open[self.tag] = self
        try:
            self._add_namespace(self.core)
            _run(["ip", "-n", self.core, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.core, "link", "set", "br0", "up"])
            for index, zone in enumerate(self.zones):
                ns = self.namespace(zone)
                self._add_namespace(ns)
                inside, outside = self._link(index, "a"), self._link(index, "b")
                # The pair is made inside the zone's namespace, its far end moved to the core.
                _run(["ip", "-n", ns, "link", "add", inside, "type", "veth", "peer", outside])
                _run(["ip", "-n", ns, "link", "set", outside, "netns", self.core])
                _run(["ip", "-n", self.core, "link", "set", outside, "master", "br0", "up"])
                _run(["ip", "-n", ns, "addr", "add", f"{self.address(zone)}/24", "dev", inside])
                # IPv4 only: no link-local IPv6 path around the rules below.
                _run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                      f"net.ipv6.conf.{inside}.disable_ipv6=1"])  # fmt: skip
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
        """Remove the rules and every namespace (their links and addresses go with them).
        Idempotent."""
        try:
            self.heal()
        finally:
            for table, chain in reversed(self._host_chains):
                _remove_chain(table, chain)
            self._host_chains.clear()
            if self._host_link:
                _run(["ip", "link", "del", self._host_link], check=False)
                self._host_link = ""
            for name in reversed(self._created):
                _run(["ip", "netns", "del", name], check=False)
            self._created.clear()
            _open.pop(self.tag, None)

    def __enter__(self) -> ZoneNetwork:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- joining the machine's loopback ------------------------------------------------------

    def attach_host(
        self, zone_ports: Mapping[str, Sequence[int]], host_ports: Mapping[str, Sequence[int]]
    ) -> None:
        """Let processes on the machine and in the zones keep using 127.0.0.1 as they do.

        Services inside a zone bind the zone namespace's loopback; a connection from the
        machine to 127.0.0.1:<one of zone_ports[zone]> is sent across the bridge to that
        zone (NAT), and a connection from inside a zone to 127.0.0.1:<one of
        host_ports[zone]> (its Envoy mesh listener, the registry, Redis) is sent to the
        machine. Nothing else crosses: every rule names tcp, those ports and this network's
        addresses, and the machine drops whatever else a zone sends its side of the bridge.
        A client on the machine bound to zone_source_address(i) is seen by the zones as
        egress(zone i), so rules inside a zone can tell which zone a proxied connection
        speaks for. Needs iptables; the machine's rules live in chains of their own,
        removed by close().
        """
        if firewall() != "iptables":
            raise NetnsError("joining the zones to the machine's loopback needs iptables")
        unknown = sorted((set(zone_ports) | set(host_ports)) - set(self.zones))
        if unknown:
            raise NetnsError(f"attach_host: no zone {unknown} in this network")
        host, far = self.host_link, f"{self.prefix}c"
        _run(["ip", "link", "add", host, "type", "veth", "peer", far])
        self._host_link = host
        _run(["ip", "link", "set", far, "netns", self.core])
        _run(["ip", "-n", self.core, "link", "set", far, "master", "br0", "up"])
        _run(["sysctl", "-qw", f"net.ipv6.conf.{host}.disable_ipv6=1"])
        _run(["ip", "addr", "add", f"{self.gateway}/24", "dev", host])
        for zone in self.zones:
            _run(["ip", "addr", "add", f"{self.egress(zone)}/32", "dev", host])
        _run(["ip", "link", "set", host, "up"])
        # 127.0.0.0/8 may leave (and arrive) through this link only because of this; it is
        # set on this link alone (never `all` or `default`) and goes away with it.
        _run(["sysctl", "-qw", f"net.ipv4.conf.{host}.route_localnet=1"])
        chains = dict(zip(NAT_CHAINS, self.nat_chains, strict=True))
        for builtin, chain in chains.items():
            _iptables("-t", "nat", "-N", chain)
            self._host_chains.append(("nat", chain))
            _iptables("-t", "nat", "-I", builtin, "-j", chain)
        _iptables("-t", "filter", "-N", self.filter_chain)
        self._host_chains.append(("filter", self.filter_chain))
        _iptables("-t", "filter", "-I", "INPUT", "-i", host, "-j", self.filter_chain)

        def nat(chain: str, *spec: str) -> None:
            _iptables("-t", "nat", "-A", chain, *spec)

        loopback = "127.0.0.1/32"
        for zone in self.zones:
            addr = f"{self.address(zone)}/32"
            for ports in _chunks(host_ports.get(zone, ())):
                # A zone's call to one of its host ports arrives at the gateway address:
                # on to the machine's loopback ...
                nat(chains["PREROUTING"], "-i", host, "-s", addr, "-d", f"{self.gateway}/32",
                    *_tcp(ports), "-j", "DNAT", "--to-destination", "127.0.0.1")  # fmt: skip
                # ... from 127.0.0.1, as the machine's services expect of local callers
                # (Redis refuses other sources in protected mode).
                nat(chains["INPUT"], "-i", host, "-s", addr, "-d", loopback, *_tcp(ports),
                    "-j", "SNAT", "--to-source", "127.0.0.1")  # fmt: skip
                _iptables("-t", "filter", "-A", self.filter_chain, "-i", host, "-s", addr,
                          "-d", loopback, *_tcp(ports), "-j", "ACCEPT")  # fmt: skip
            for ports in _chunks(zone_ports.get(zone, ())):
                nat(chains["OUTPUT"], "-d", loopback, *_tcp(ports), "-j", "DNAT",
                    "--to-destination", self.address(zone))  # fmt: skip
                for index, speaker in enumerate(self.zones):
                    nat(chains["POSTROUTING"], "-o", host, "-s",
                        f"{zone_source_address(index)}/32", "-d", addr, *_tcp(ports),
                        "-j", "SNAT", "--to-source", self.egress(speaker))  # fmt: skip
                nat(chains["POSTROUTING"], "-o", host, "-s", loopback, "-d", addr, *_tcp(ports),
                    "-j", "SNAT", "--to-source", self.gateway)  # fmt: skip
        # Replies to the machine's own calls into the zones; nothing else a zone sends.
        _iptables("-t", "filter", "-A", self.filter_chain, "-i", host, "-m", "conntrack",
                  "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
        _iptables("-t", "filter", "-A", self.filter_chain, "-i", host, "-j", "DROP")

        # Inside each zone (the namespace's own tables, gone with it).
        callers = [f"{self.gateway}/32", *(f"{self.egress(z)}/32" for z in self.zones)]
        for zone in self.zones:
            ns, link, addr = self.namespace(zone), self.link(zone), f"{self.address(zone)}/32"
            _run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                  f"net.ipv4.conf.{link}.route_localnet=1"])  # fmt: skip
            for ports in _chunks(zone_ports.get(zone, ())):
                for caller in callers:
                    _iptables("-t", "nat", "-A", "PREROUTING", "-i", link, "-s", caller,
                              "-d", addr, *_tcp(ports), "-j", "DNAT",
                              "--to-destination", "127.0.0.1", netns=ns)  # fmt: skip
            for ports in _chunks(host_ports.get(zone, ())):
                _iptables("-t", "nat", "-A", "OUTPUT", "-d", loopback, *_tcp(ports), "-j",
                          "DNAT", "--to-destination", self.gateway, netns=ns)  # fmt: skip
                _iptables("-t", "nat", "-A", "POSTROUTING", "-o", link, "-s", loopback,
                          "-d", f"{self.gateway}/32", *_tcp(ports), "-j", "SNAT",
                          "--to-source", self.address(zone), netns=ns)  # fmt: skip

    def join_zones(self, replica_ports: Mapping[str, Sequence[int]]) -> None:
        """Let a process inside one zone reach the other zones' replicas at 127.0.0.1, as a
        process on the machine does (each zone's own Envoy, in the per-zone layout): a
        connection from inside zone Z to 127.0.0.1:<one of replica_ports[other]> crosses the
        bridge from Z's own address straight to that zone, where it arrives on loopback.
        Every rule names tcp, those ports and this network's addresses, inside the zones'
        namespaces (gone with them); a partition between two zones drops these calls too,
        since they travel between the zones' own addresses. Call after attach_host (which
        lets 127.0.0.0/8 cross each zone's link)."""
        unknown = sorted(set(replica_ports) - set(self.zones))
        if unknown:
            raise NetnsError(f"join_zones: no zone {unknown} in this network")
        for here in self.zones:
            ns, link, source = self.namespace(here), self.link(here), self.address(here)
            for there in self.zones:
                if there == here:
                    continue
                target = self.address(there)
                for ports in _chunks(replica_ports.get(there, ())):
                    _iptables("-t", "nat", "-A", "OUTPUT", "-d", "127.0.0.1/32", *_tcp(ports),
                              "-j", "DNAT", "--to-destination", target, netns=ns)  # fmt: skip
                    _iptables("-t", "nat", "-A", "POSTROUTING", "-o", link, "-s", "127.0.0.0/8",
                              "-d", f"{target}/32", *_tcp(ports), "-j", "SNAT",
                              "--to-source", source, netns=ns)  # fmt: skip
                    _iptables("-t", "nat", "-A", "PREROUTING", "-i", self.link(there),
                              "-s", f"{source}/32", "-d", f"{target}/32", *_tcp(ports), "-j",
                              "DNAT", "--to-destination", "127.0.0.1",
                              netns=self.namespace(there))  # fmt: skip

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
                    _iptables("-I", *spec, netns=ns)
                    self._rules.append((ns, ["iptables", "-w", "5", "-D", *spec]))
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
