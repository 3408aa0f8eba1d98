"""What the fork server forks in tests/unit/test_forkserver.py.

`python -m tests.unit.forked_child REPORT [EXIT_CODE]` writes what it became to REPORT (JSON),
says "up", then exits with EXIT_CODE or, without one, waits for SIGTERM (then exits 0).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def main() -> int:
    report = Path(sys.argv[1])
    umask = os.umask(0)
    os.umask(umask)
    became = {
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "umask": umask,
        "sid": os.getsid(0),
        "pid": os.getpid(),
        # Imported by the fork server beforehand, never by this module.
        "preloaded": "servemesh.spec" in sys.modules,
    }
    # Whole or not at all: the test's readiness check is the file's existence.
    partial = report.with_name(report.name + ".partial")
    partial.write_text(json.dumps(became))
    partial.rename(report)
    print("up")
    if len(sys.argv) > 2:
        return int(sys.argv[2])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    raise SystemExit(main())
