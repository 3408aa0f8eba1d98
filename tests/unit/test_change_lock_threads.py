"""The change lock is re-entrant for one thread only: another thread of the same process
(two events of one load run, say) is refused, never let in to interleave."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from servemesh.proxy.apply import ApplyError, MeshPaths


def test_another_thread_of_the_same_process_is_refused(tmp_path: Path) -> None:
    paths = MeshPaths(tmp_path)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with paths.change_lock():
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(30)
        with pytest.raises(ApplyError, match=f"under way \\(pid {os.getpid()}\\)"):
            with paths.change_lock():
                pass
    finally:
        release.set()
        thread.join(30)
    with paths.change_lock(), paths.change_lock():  # free again, and re-entrant here
        pass
