"""What the netns tests share: tiny TCP servers and probes, and what the machine holds."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

from servemesh.procs import Check
from servemesh.procs.netns import available

CAN, WHY = available()
needs_netns = pytest.mark.skipif(not CAN, reason=f"zone namespaces unavailable here: {WHY}")

# Listens on (host, port), says `ready`, answers every connection with its name.
SERVE = (
    "import socket, sys\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(16); print('ready', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(sys.argv[3].encode()); c.close()\n"
)
# Exit 0 printing what the server at (host, port) said; 2 when it cannot be reached.
CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as c:\n"
    "        print(c.recv(64).decode())\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__); sys.exit(2)\n"
)


def said_ready(log: Path) -> Check:
    return Check(lambda: log.exists() and "ready" in log.read_text(), f"{log.stem} listening")


def free_port() -> int:
    """A port nothing on the machine listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split(" ", 1)[0] for line in listed.splitlines()]


def links() -> list[str]:
    listed = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line.split(": ", 2)[1].split("@", 1)[0] for line in listed.splitlines()]


def chains(table: str = "nat") -> list[str]:
    rules = subprocess.run(["iptables", "-w", "5", "-t", table, "-S"], capture_output=True,
                           text=True).stdout  # fmt: skip
    return [line.split()[1] for line in rules.splitlines() if line.startswith("-N ")]


def owned_by(pid: int) -> list[str]:
    """Every namespace, machine link and chain whose name carries `pid`."""
    mine = re.compile(rf"^(sm|SM){pid}-")
    found = namespaces() + links() + chains("nat") + chains("filter")
    return [name for name in found if mine.match(name)]


def capabilities(pid: int) -> dict[str, str]:
    """The Uid line and the Cap* lines of /proc/<pid>/status."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    keys = ("Uid", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")
    return {k: fields[k].split()[0] for k in keys}
