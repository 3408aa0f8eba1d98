"""One mesh per state dir (servemesh/state/lock.py): a held lock refuses a second start at
once, naming the holder; a lock a killed mesh left is taken over; a clean release leaves
the state dir free. Liveness is the kernel's lock, so a holder in another process counts
as long as that process lives, and no longer."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from servemesh.contract.errors import GATE_REFUSED
from servemesh.state.lock import (
    Holder,
    MeshLock,
    StateDirHeld,
    live_holder,
    lock_path,
    refuse_if_held,
)


def _dead_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_held_state_dir_refuses_a_second_start_naming_the_holder(tmp_path: Path) -> None:
    lock, left = MeshLock.take(tmp_path, "127.0.0.1:8080")
    assert left is None
    try:
        holder = live_holder(tmp_path)
        assert holder is not None
        assert (holder.pid, holder.edge) == (os.getpid(), "127.0.0.1:8080")
        with pytest.raises(StateDirHeld) as refused:
            MeshLock.take(tmp_path, "127.0.0.1:9090")
        assert refused.value.exit_code == GATE_REFUSED
        assert f"a mesh is already running from {tmp_path} (pid {os.getpid()}, edge " in str(
            refused.value
        )
        with pytest.raises(StateDirHeld):
            refuse_if_held(tmp_path)
    finally:
        lock.release()
    # Released cleanly: free, and the file names nobody (the next start takes over nothing).
    assert live_holder(tmp_path) is None
    assert lock_path(tmp_path).read_text() == ""
    again, left = MeshLock.take(tmp_path, "127.0.0.1:8080")
    again.release()
    assert left is None


def test_a_lock_left_by_a_killed_mesh_is_taken_over(tmp_path: Path) -> None:
    dead = Holder(_dead_pid(), "127.0.0.1:18080", 1.0)
    lock_path(tmp_path).write_text(dead.as_json())
    assert live_holder(tmp_path) is None
    refuse_if_held(tmp_path)  # nothing to refuse
    lock, left = MeshLock.take(tmp_path, "127.0.0.1:8080")
    try:
        assert left == dead
        holder = live_holder(tmp_path)
        assert holder is not None and holder.pid == os.getpid()
    finally:
        lock.release()


def test_another_process_holds_it_while_it_lives(tmp_path: Path) -> None:
    # A holder in a child: held (and named) while the child runs, free once it exits,
    # however it exits (SIGKILL: no release ran, the kernel dropped the lock).
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from servemesh.state.lock import MeshLock
        MeshLock.take(Path({str(tmp_path)!r}), "127.0.0.1:7070")
        print("held", flush=True)
        sys.stdin.read()
        """
    )
    argv = [sys.executable, "-c", script]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "held"
            holder = live_holder(tmp_path)
            assert holder is not None
            assert (holder.pid, holder.edge) == (child.pid, "127.0.0.1:7070")
            with pytest.raises(StateDirHeld, match=f"pid {child.pid}, edge 127.0.0.1:7070"):
                MeshLock.take(tmp_path, "127.0.0.1:8080")
        finally:
            child.kill()
            child.wait()
    assert live_holder(tmp_path) is None
    lock, left = MeshLock.take(tmp_path, "127.0.0.1:8080")
    lock.release()
    assert left is not None and left.pid == child.pid


def test_a_symlinked_lock_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    lock_path(tmp_path).symlink_to(target)
    with pytest.raises(Exception, match="is a symlink"):
        MeshLock.take(tmp_path, "127.0.0.1:8080")
