"""One change to a running mesh at a time: a second one is refused at once, naming the first."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from servemesh.proxy.apply import RouteManager
from servemesh.state.paths import ApplyError, MeshPaths

HOLDER = """
import sys
from pathlib import Path
from servemesh.state.paths import MeshPaths
with MeshPaths(Path(sys.argv[1])).change_lock():
    print("locked", flush=True)
    sys.stdin.readline()
"""


def test_a_change_while_another_process_holds_the_lock_is_refused(tmp_path: Path) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        assert holder.stdin is not None and holder.stdout is not None
        try:
            assert holder.stdout.readline().strip() == "locked"
            with pytest.raises(ApplyError) as refused:
                RouteManager(MeshPaths(tmp_path)).set_weights("fraud", {"v1": 100})
            assert f"under way (pid {holder.pid})" in str(refused.value)
        finally:
            holder.stdin.close()  # the holder reads EOF, releases and exits
            holder.wait(timeout=30)
    # Released: the next change gets as far as finding no running mesh here.
    with pytest.raises(ApplyError, match="no running mesh"):
        RouteManager(MeshPaths(tmp_path)).set_weights("fraud", {"v1": 100})


def test_the_lock_is_reentrant_within_one_process(tmp_path: Path) -> None:
    paths = MeshPaths(tmp_path)
    with paths.change_lock(), paths.change_lock():
        pass
    with paths.change_lock():  # and free again afterwards
        pass


def test_threads_of_one_process_take_turns(tmp_path: Path) -> None:
    import threading

    paths = MeshPaths(tmp_path)
    inside = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def first() -> None:
        with paths.change_lock():
            order.append("first in")
            inside.set()
            release.wait(timeout=30)
            order.append("first out")

    def second() -> None:
        with paths.change_lock(), paths.change_lock():  # re-entrant in its own thread too
            order.append("second in")

    one = threading.Thread(target=first)
    one.start()
    assert inside.wait(timeout=30)
    two = threading.Thread(target=second)
    two.start()
    two.join(timeout=0.2)  # it must be waiting, not inside, while the first holds the lock
    assert order == ["first in"]
    release.set()
    one.join(timeout=30)
    two.join(timeout=30)
    assert order == ["first in", "first out", "second in"]
