"""What a fault leaves running that the end of a drill must undo in any case.

Paused replicas (SIGSTOP) are continued, background fault loops (a crash loop, a slow
Redis) are stopped, and CPU hogs and rollout controllers are killed, whether the drill
ended well, was aborted by its guard, or crashed.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from servemesh.procs import Supervisor

log = logging.getLogger(__name__)

# The longest one step of a background fault loop may take (the crash loop's restart of a
# model server, which can take half a minute on a busy machine). Stopping a loop waits for
# its step to end, with some slack: a loop still in a step when the mesh stops would start
# a replica behind the mesh's back.
LOOP_STEP_MAX_S = 60.0
LOOP_STOP_TIMEOUT_S = LOOP_STEP_MAX_S + 15.0


class Leftovers:
    def __init__(self) -> None:
        self.paused: dict[str, int] = {}  # name -> pid under SIGSTOP
        self._background: dict[str, tuple[threading.Thread, threading.Event]] = {}
        # CPU hogs die with the drill's process (SIGKILL), not only when stopped.
        self._hogs = Supervisor(death_signal=signal.SIGKILL, grace_s=0, thread_name="hog-spawner")
        self._hog_count = 0
        # `servemesh rollout` controllers a drill runs (chaos/rollouts.py), made on first use
        # with the folder their output goes to.
        self._commands: Supervisor | None = None

    # --- paused processes ----------------------------------------------------------------

    def is_paused(self, name: str) -> bool:
        return name in self.paused

    def paused_with(self, name: str, pid: int) -> None:
        """Remember that `name` (PID `pid`) was stopped with SIGSTOP."""
        self.paused[name] = pid

    def forget_pause(self, name: str) -> None:
        """The paused process is gone (killed): nothing to continue."""
        self.paused.pop(name, None)

    def resume(self, name: str) -> bool:
        """SIGCONT what was paused under `name`; False when it was not (or is gone)."""
        pid = self.paused.pop(name, None)
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return False
        return True

    def resume_all(self) -> None:
        for name in list(self.paused):
            self.resume(name)

    # --- background fault loops ---------------------------------------------------------

    def start_background(self, key: str, target: Callable[[threading.Event], None]) -> None:
        """Run target(stop_event) in a thread until stop_background(key)."""
        if key in self._background:
            return
        stop = threading.Event()
        thread = threading.Thread(target=target, args=(stop,), name=f"drill-{key}", daemon=True)
        self._background[key] = (thread, stop)
        thread.start()

    def stop_background(
        self, key: str | None = None, timeout_s: float = LOOP_STOP_TIMEOUT_S
    ) -> list[str]:
        """Stop one loop (or all of them) and wait for it, each at most `timeout_s` (a loop
        in the middle of a step ends it first); the keys stopped."""
        keys = [key] if key is not None else list(self._background)
        stopped = []
        for name in keys:
            entry = self._background.pop(name, None)
            if entry is None:
                continue
            thread, stop = entry
            stop.set()
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("drill loop %s still running after %g s", name, timeout_s)
            stopped.append(name)
        return stopped

    # --- CPU hogs --------------------------------------------------------------------------

    def spawn_hog(self) -> int:
        """A process that burns one CPU until stopped (by PID) or this process dies."""
        self._hog_count += 1
        argv = [sys.executable, "-c", "while True: pass"]
        return self._hogs.start(f"cpu-hog-{self._hog_count}", argv, log=False).pid

    def stop_hogs(self) -> list[int]:
        pids = list(self._hogs.pids().values())
        self._hogs.stop_all()
        return pids

    # --- commands a drill runs (rollout controllers) ---------------------------------------

    def commands(self, logs_dir: Path) -> Supervisor:
        """The supervisor of the commands a drill starts; each logs to <logs_dir>/<name>.log
        and dies with the drill's process."""
        if self._commands is None:
            self._commands = Supervisor(
                logs_dir, death_signal=signal.SIGKILL, grace_s=5, thread_name="command-spawner"
            )
        return self._commands

    def close(self) -> None:
        """Undo everything: loops stopped, paused processes continued, hogs and commands
        killed."""
        try:
            self.stop_background()
            self.resume_all()
        finally:
            try:
                self._hogs.close()
            finally:
                if self._commands is not None:
                    self._commands.close()
