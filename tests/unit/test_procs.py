"""The process supervisor with real children: readiness, errors with the log, tiers, restarts,
the parent-death signal, and a Redis outage and its way back."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from servemesh.procs import (
    Check,
    ProcessError,
    RedisServer,
    StartError,
    Supervisor,
    TcpPort,
)
from servemesh.spec import free_port

PY = sys.executable
# Serves TCP on argv[1]; on SIGTERM, appends argv[2] to the file argv[3] and exits 0.
SERVER = (
    "import signal, socket, sys\n"
    "def bye(*_):\n"
    "    with open(sys.argv[3], 'a') as f: f.write(sys.argv[2] + '\\n')\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, bye)\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(8)\n"
    "print('listening', flush=True)\n"
    "while True: s.accept()[0].close()\n"
)


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll a condition until it holds (True) or the time is up (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not running either.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    with Supervisor(tmp_path / "logs", grace_s=5.0) as sup:
        yield sup


def serve(sup: Supervisor, name: str, tmp_path: Path, group: str | None = None) -> int:
    port = free_port("127.0.0.1")
    argv = [PY, "-c", SERVER, str(port), name, str(tmp_path / "stopped.txt")]
    sup.start(name, argv, group=group, ready=TcpPort("127.0.0.1", port), timeout_s=30)
    return port


def test_a_child_is_ready_logged_and_stopped_by_sigterm(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    serve(supervisor, "web", tmp_path)
    pid = supervisor.pid("web")
    assert supervisor.is_running("web") and pid_alive(pid)
    assert "listening" in (tmp_path / "logs" / "web.log").read_text()
    assert supervisor.stop("web") == 0  # it handled SIGTERM: exit status 0
    assert not pid_alive(pid) and "web" not in supervisor.children
    assert (tmp_path / "stopped.txt").read_text() == "web\n"


def test_a_child_that_dies_while_starting_fails_with_its_log(supervisor: Supervisor) -> None:
    argv = [PY, "-c", "print('bad config: port 0'); raise SystemExit(3)"]
    with pytest.raises(StartError) as failed:
        supervisor.start("broken", argv, ready=Check(lambda: False, "never"), timeout_s=30)
    assert "broken exited with 3 while starting" in str(failed.value)
    assert "bad config: port 0" in str(failed.value)


def test_a_child_never_ready_fails_at_the_deadline_naming_its_check(
    supervisor: Supervisor,
) -> None:
    argv = [PY, "-c", "import time; print('warming up', flush=True); time.sleep(60)"]
    began = time.monotonic()
    with pytest.raises(StartError) as failed:
        supervisor.start("slow", argv, ready=Check(lambda: False, "a file appears"), timeout_s=1)
    assert time.monotonic() - began < 10
    message = str(failed.value)
    assert "slow was not ready in time (a file appears)" in message and "warming up" in message
    supervisor.stop("slow")


def test_stop_all_goes_tier_by_tier_and_kills_what_ignores_sigterm(
    tmp_path: Path,
) -> None:
    with Supervisor(tmp_path / "logs", grace_s=0.5) as sup:
        serve(sup, "db", tmp_path, group="db")
        serve(sup, "app-1", tmp_path, group="app")
        serve(sup, "app-2", tmp_path, group="app")
        serve(sup, "proxy", tmp_path, group="proxy")
        stubborn = [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                    "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"]  # fmt: skip
        log = tmp_path / "logs" / "stubborn.log"
        said_up = Check(lambda: "up" in log.read_text(), "says up")
        sup.start("stubborn", stubborn, group="app", ready=said_up)
        pids = sup.pids()
        sup.stop_all([["proxy"], ["app"], ["db"]])
    order = (tmp_path / "stopped.txt").read_text().split()
    assert order[0] == "proxy" and set(order[1:3]) == {"app-1", "app-2"} and order[3] == "db"
    assert not [name for name, pid in pids.items() if pid_alive(pid)]  # stubborn: SIGKILLed


def test_a_killed_child_restarts_as_it_was_started(supervisor: Supervisor, tmp_path: Path) -> None:
    port = serve(supervisor, "web", tmp_path)
    first = supervisor.kill("web")
    assert not supervisor.is_running("web") and not pid_alive(first)
    with pytest.raises(ProcessError, match="web is not running"):
        supervisor.send_signal("web", signal.SIGTERM)
    second = supervisor.restart("web").pid
    assert second != first and supervisor.is_running("web")
    assert TcpPort("127.0.0.1", port).check()  # same argv, same port, ready again
    with pytest.raises(ProcessError, match="still running"):
        supervisor.restart("web")
    # Both runs wrote to the same log.
    assert (tmp_path / "logs" / "web.log").read_text().count("listening") == 2


def test_a_kill_holds_the_child_down_until_restart_and_a_pause_holds_nothing(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    serve(supervisor, "web", tmp_path)
    supervisor.kill("web", signal.SIGSTOP)  # paused, not ended: nothing to hold
    assert supervisor.is_running("web") and not supervisor.child("web").held
    supervisor.send_signal("web", signal.SIGCONT)
    supervisor.kill("web")
    assert supervisor.child("web").held and not supervisor.child("web").stopped
    # Started again without waiting for it (an owner checks its readiness itself).
    child = supervisor.restart("web", wait=False)
    assert not child.held and child.ready is not None
    supervisor.wait_ready(["web"], time.monotonic() + 30)
    # A kill that asks not to hold: a crash as its owner sees it.
    supervisor.kill("web", hold=False)
    assert not supervisor.child("web").held and not supervisor.is_running("web")
    with pytest.raises(ProcessError, match="web is not running"):
        supervisor.kill("web")


def test_reap_reports_children_that_exited_on_their_own_once(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    serve(supervisor, "steady", tmp_path)
    quitter = supervisor.start("quitter", [PY, "-c", "raise SystemExit(7)"])
    quitter.wait(10)
    reaped = supervisor.reap()
    assert [(c.name, c.returncode) for c in reaped] == [("quitter", 7)]
    assert supervisor.reap() == [] and set(supervisor.children) == {"steady"}


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_children_die_with_their_parent_even_when_it_is_killed(tmp_path: Path) -> None:
    # A parent that starts a child from a short-lived thread (as a restart does), reports
    # both PIDs, then waits; we SIGKILL the parent, and the child must go too.
    parent_code = (
        "import sys, threading, time\n"
        "from pathlib import Path\n"
        "from servemesh.procs import Check, Supervisor\n"
        "sup = Supervisor(Path(sys.argv[1]))\n"
        "log = Path(sys.argv[1]) / 'child.log'\n"
        "up = Check(lambda: 'up' in log.read_text(), 'up')\n"
        "code = 'import time; print(\"up\", flush=True); time.sleep(120)'\n"
        "box = []\n"
        "t = threading.Thread(target=lambda: box.append(sup.start('child', "
        "[sys.executable, '-c', code], ready=up).pid))\n"
        "t.start(); t.join()\n"
        "print(box[0], flush=True)\n"
        "time.sleep(120)\n"
    )
    with Supervisor(tmp_path / "outer") as outer:
        parent = outer.start("parent", [PY, "-c", parent_code, str(tmp_path / "inner")])
        log = tmp_path / "outer" / "parent.log"
        assert wait_for(lambda: log.read_text().strip().isdigit(), 30), log.read_text()
        child = int(log.read_text().strip())
        # The thread that asked for the child (once it was up) has ended: the child lives
        # on. (Forked from that thread, it would get its parent-death signal now.)
        assert not wait_for(lambda: not pid_alive(child), timeout_s=1.0)
        outer.kill("parent", signal.SIGKILL)
        assert not pid_alive(parent.pid)
        assert wait_for(lambda: not pid_alive(child)), "the child outlived its parent"


def test_redis_outage_keeps_the_data_and_comes_back_on_its_port(tmp_path: Path) -> None:
    with Supervisor(tmp_path / "logs") as sup:
        server = RedisServer(sup, tmp_path / "data")
        first = server.start()
        url = server.url
        client = server.client()
        try:
            client.set("entity", "42")
            assert server.outage() == first
            assert not server.is_running() and not pid_alive(first)
            assert not TcpPort("127.0.0.1", server.port).check()
            second = server.start()
            assert second != first and server.url == url
            assert client.get("entity") == b"42"  # from the snapshot taken at the outage
        finally:
            client.close()
        pid = server.pid
    assert not pid_alive(pid)
