"""The fork server with real children: a forked service is the process its argv describes,
its exits and signals read as Popen's, what it does not run is exec'd, and no child
outlives the server or its owner."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from servemesh.observe.cpu import descendants
from servemesh.procs import Check, Supervisor
from servemesh.procs.forkserver import ForkServer, ForkServerError
from tests.waiting import wait_until

PY = sys.executable
TARGET = "tests.unit.forked_child"
FORKED = {TARGET: ("servemesh.spec",)}


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    with Supervisor(tmp_path / "logs", cwd=tmp_path, grace_s=5.0, forked=FORKED) as sup:
        yield sup


def start(sup: Supervisor, name: str, report: Path, *extra: str, **kwargs: object) -> int:
    argv = [PY, "-m", TARGET, str(report), *extra]
    ready = Check(report.exists, f"{report} written")
    return sup.start(name, argv, ready=ready, timeout_s=60, **kwargs).pid  # type: ignore[arg-type]


def test_a_forked_child_is_the_process_its_argv_describes(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    report = tmp_path / "became.json"
    pid = start(supervisor, "svc", report, env={"MARK": "given"})
    became = json.loads(report.read_text())
    # Forked from the server, which had imported servemesh.spec already.
    assert parent_of(pid) != os.getpid() and became["preloaded"] is True
    assert became["pid"] == pid and became["sid"] == pid  # a session of its own
    assert became["argv"][0].endswith("forked_child.py") and became["argv"][1:] == [str(report)]
    assert became["cwd"] == str(tmp_path)
    assert became["env"]["MARK"] == "given" and became["env"]["PYTHONUNBUFFERED"] == "1"
    assert became["umask"] == 0o077
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert f"-m {TARGET} {report}" in cmdline  # what ps shows: the service, not the server
    assert Path(f"/proc/{pid}/comm").read_text().startswith("python")
    wait_until(lambda: "up" in (tmp_path / "logs" / "svc.log").read_text(), "the child's log")
    assert supervisor.stop("svc") == 0  # it handled SIGTERM
    assert gone(pid)


def test_exits_kills_and_waits_read_as_popens(supervisor: Supervisor, tmp_path: Path) -> None:
    quitter = supervisor.start("quitter", [PY, "-m", TARGET, str(tmp_path / "q.json"), "7"])
    assert quitter.wait(30) == 7
    assert [(c.name, c.returncode) for c in supervisor.reap()] == [("quitter", 7)]

    pid = start(supervisor, "svc", tmp_path / "svc.json")
    server = parent_of(pid)
    with pytest.raises(subprocess.TimeoutExpired):
        supervisor.child("svc").wait(0.2)
    assert supervisor.kill("svc") == pid and supervisor.child("svc").returncode == -9
    assert gone(pid)
    # Started again the same way: forked again.
    (tmp_path / "svc.json").unlink()
    again = supervisor.restart("svc").pid
    assert again != pid and parent_of(again) == server != os.getpid()
    supervisor.send_signal("svc", signal.SIGTERM)
    assert supervisor.child("svc").wait(30) == 0


def test_what_the_server_does_not_run_is_execd(supervisor: Supervisor, tmp_path: Path) -> None:
    report = tmp_path / "c.json"
    code = (
        f"import runpy, sys; sys.argv = ['x', {str(report)!r}]; "
        f"runpy.run_module({TARGET!r}, run_name='__main__')"
    )
    root = str(Path(__file__).resolve().parents[2])  # `tests` importable from any cwd
    child = supervisor.start(
        "inline", [PY, "-c", code], ready=Check(report.exists, "report"), env={"PYTHONPATH": root}
    )
    assert parent_of(child.pid) == os.getpid()
    assert json.loads(report.read_text())["preloaded"] is False
    supervisor.stop("inline")


def test_a_server_that_cannot_start_leaves_children_execd(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = {TARGET: ("servemesh.no_such_module",)}
    with caplog.at_level(logging.WARNING), Supervisor(tmp_path / "logs", forked=broken) as sup:
        sup.prepare_fork_server()  # started early, failing only once waited for
        pid = start(sup, "svc", tmp_path / "r.json")
        assert parent_of(pid) == os.getpid()
        assert json.loads((tmp_path / "r.json").read_text())["preloaded"] is False
    assert "no fork server" in caplog.text and "no_such_module" in caplog.text
    assert gone(pid)


def test_a_server_prepared_early_is_the_one_children_are_forked_from(tmp_path: Path) -> None:
    with Supervisor(tmp_path / "logs", forked=FORKED) as sup:
        sup.prepare_fork_server()
        servers = [
            pid
            for pid in descendants(os.getpid())
            if b"servemesh.procs.forkserver" in _cmdline(pid)
        ]
        assert len(servers) == 1  # running before any service asked for it
        assert sup.fork_server_pids() == {"forkserver": servers[0]}
        first = start(sup, "one", tmp_path / "one.json")
        second = start(sup, "two", tmp_path / "two.json")
        assert parent_of(first) == parent_of(second) == servers[0]
    assert gone(servers[0]) and gone(first) and gone(second)


def test_a_module_it_was_not_given_is_refused(tmp_path: Path) -> None:
    server = ForkServer(FORKED, tmp_path / "forkserver.log")
    server.start()
    try:
        with pytest.raises(ForkServerError, match="not one this server runs"):
            server.spawn([PY, "-m", "os"], env={}, cwd=None, umask=0o077,
                         death_signal=signal.SIGTERM, out_fd=None)  # fmt: skip
    finally:
        server.close()


def test_children_go_with_the_server(supervisor: Supervisor, tmp_path: Path) -> None:
    pid = start(supervisor, "svc", tmp_path / "svc.json")
    server = parent_of(pid)
    os.kill(server, signal.SIGKILL)
    wait_until(lambda: gone(pid), "the child gone with its fork server")
    child = supervisor.child("svc")
    wait_until(lambda: child.returncode is not None, "its exit known")
    assert child.returncode == -signal.SIGTERM  # its death signal, as far as we can know


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_forked_children_die_with_their_owner_even_when_it_is_killed(tmp_path: Path) -> None:
    owner_code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from servemesh.procs import Check, Supervisor\n"
        "report = Path(sys.argv[2])\n"
        f"sup = Supervisor(Path(sys.argv[1]), forked={{{TARGET!r}: ()}})\n"
        f"child = sup.start('svc', [sys.executable, '-m', {TARGET!r}, str(report)], "
        "ready=Check(report.exists, 'report'))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    with Supervisor(tmp_path / "outer") as outer:
        owner = outer.start("owner", [PY, "-c", owner_code, str(tmp_path / "inner"),
                                      str(tmp_path / "r.json")])  # fmt: skip
        log = tmp_path / "outer" / "owner.log"
        wait_until(lambda: log.read_text().strip().isdigit(), "the owner's child PID", timeout_s=60)
        child = int(log.read_text().strip())
        server = parent_of(child)
        assert server != owner.pid and parent_of(server) == owner.pid
        outer.kill("owner", signal.SIGKILL)
        wait_until(lambda: gone(server), "the fork server gone with its owner")
        wait_until(lambda: gone(child), "the forked child gone with its owner")


@pytest.mark.skipif(os.geteuid() != 0, reason="running a child as another user needs root")
def test_another_users_children_come_from_a_server_of_that_user_that_no_one_can_read(
    tmp_path: Path,
) -> None:
    from servemesh.procs.sandbox import OFFLINE_GID, OFFLINE_UID, RunAs

    user = RunAs(uid=OFFLINE_UID, gid=OFFLINE_GID)
    # A folder that user may write its report in (the test's own tmp_path is root's 0700).
    shared = Path(tempfile.mkdtemp(prefix="forkserver-as-", dir="/tmp"))
    shared.chmod(0o777)
    try:
        with Supervisor(tmp_path / "logs", forked_as=FORKED) as sup:
            first = start(sup, "one", shared / "one.json", run_as=user)
            second = start(sup, "two", shared / "two.json", run_as=user)
            server = parent_of(first)
            assert server == parent_of(second) != os.getpid()
            assert sup.fork_server_pids() == {f"forkserver-{OFFLINE_UID}": server}
            for pid in (server, first, second):
                status = Path(f"/proc/{pid}/status").read_text()
                uids = next(line for line in status.splitlines() if line.startswith("Uid:"))
                assert uids.split()[1:] == [str(OFFLINE_UID)] * 4, (pid, uids)
                # Not dumpable: its /proc files are root's, so no process of that user (a
                # model server of the same pool) reads or writes its memory.
                assert os.stat(f"/proc/{pid}/mem").st_uid == 0, pid
            assert json.loads((shared / "one.json").read_text())["preloaded"] is True
            # Its own server, not this user's: what this process runs is exec'd.
            mine = start(sup, "mine", shared / "mine.json")
            assert parent_of(mine) == os.getpid()
        assert gone(server) and gone(first) and gone(second)
    finally:
        shutil.rmtree(shared)
