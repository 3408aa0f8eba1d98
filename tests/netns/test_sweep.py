"""What a killed owner leaves behind is swept at the next start; a live owner's never is.

Two child processes each create a zone network joined to the machine (namespaces, the
machine's link, NAT and filter chains), then one is SIGKILLed: it can close nothing. The
next network created sweeps exactly the dead one's names and leaves the live one's; the
live one, stopped by SIGTERM, closes its own on the way out.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servemesh.procs import Check, Supervisor
from servemesh.procs.netns import ZoneNetwork
from tests.netns.helpers import free_port, needs_netns, owned_by

# Creates a network, prints its names as JSON, then waits; SIGTERM exits through atexit.
OWNER = (
    "import json, signal, sys, time\n"
    "from servemesh.procs.netns import ZoneNetwork\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
    "net = ZoneNetwork(['zone-a', 'zone-b']).create()\n"
    "net.attach_host({'zone-a': [int(sys.argv[1])]}, {'zone-a': [int(sys.argv[2])]})\n"
    "print(json.dumps({'pid': net.pid, 'tag': net.tag, 'namespaces': net.namespaces,\n"
    "                  'link': net.host_link, 'chains': [*net.nat_chains, net.filter_chain]}),\n"
    "      flush=True)\n"
    "signal.pause()\n"
)


def printed(log: Path) -> dict[str, Any] | None:
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def has_printed(log: Path) -> Callable[[], bool]:
    return lambda: printed(log) is not None


@needs_netns
def test_a_dead_owners_network_is_swept_and_a_live_ones_is_left(tmp_path: Path) -> None:
    with Supervisor(tmp_path) as owners:
        names: dict[str, dict[str, Any]] = {}
        for owner in ("dead", "live"):
            argv = [sys.executable, "-c", OWNER, str(free_port()), str(free_port())]
            log = tmp_path / f"{owner}.log"
            owners.start(owner, argv, ready=Check(has_printed(log), f"{owner} created its network"))
            found = printed(log)
            assert found is not None
            names[owner] = found
        dead_pid, live_pid = owners.pid("dead"), owners.pid("live")
        assert names["dead"] and names["dead"]["pid"] == dead_pid
        before_dead, before_live = owned_by(dead_pid), owned_by(live_pid)
        # Three namespaces, the machine's link, four NAT chains and one filter chain each.
        assert len(before_dead) == len(before_live) == 3 + 1 + 5
        owners.kill("dead", signal.SIGKILL)
        assert owned_by(dead_pid) == before_dead  # a killed process closes nothing

        net = ZoneNetwork(["zone-a"]).create()
        try:
            swept = [s for s in net.swept if s.pid in (dead_pid, live_pid)]
            assert [(s.pid, s.tag) for s in swept] == [(dead_pid, names["dead"]["tag"])]
            (gone,) = swept
            assert sorted(gone.namespaces) == sorted(names["dead"]["namespaces"])
            assert gone.links == [names["dead"]["link"]]
            assert sorted(c for _, c in gone.chains) == sorted(names["dead"]["chains"])
            assert owned_by(dead_pid) == []
            assert owned_by(live_pid) == before_live
        finally:
            net.close()
        # The live owner, stopped by SIGTERM, removes its own.
        assert owners.stop("live", grace_s=30) == 0
        assert owned_by(live_pid) == []
