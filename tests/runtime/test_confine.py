"""The walls a process puts up around itself before model code runs
(services/runtime/confine.py), tried from a child process that confines itself and then
attempts each forbidden call: the two profiles, and what each leaves open on purpose."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servemesh.services.runtime.confine import SandboxPolicy

ATTEMPTS = r"""
import errno, json, os, signal, socket, sys
from servemesh.services.runtime.confine import SandboxPolicy, confine, server_policy
profile, folder = sys.argv[1], sys.argv[2]
confine(server_policy(16 << 30) if profile == "server" else
        SandboxPolicy(violation="errno", file_size_bytes=None))
def attempt(call):
    try:
        call()
        return "allowed"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
def spawn():
    if os.fork() == 0:
        os._exit(0)
def write():
    with open(os.path.join(folder, "new"), "w") as f:
        f.write("x")
def listen():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.close()
results = {
    "exec": attempt(lambda: os.execv("/bin/true", ["true"])),
    "fork": attempt(spawn),
    "signal its parent": attempt(lambda: os.kill(os.getppid(), 0)),
    "signal itself": attempt(lambda: os.kill(os.getpid(), 0)),
    "chmod": attempt(lambda: os.chmod(folder, 0o777)),
    "symlink": attempt(lambda: os.symlink("/etc/passwd", os.path.join(folder, "l"))),
    "write a new file": attempt(write),
    "a socket": attempt(listen),
    "read a file": attempt(lambda: open("/etc/hostname").read()),
}
print(json.dumps(results))
"""


def attempts(profile: str, folder: Path) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", ATTEMPTS, profile, str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_model_process_may_read_and_compute_and_nothing_else(tmp_path: Path) -> None:
    got = attempts("model", tmp_path)
    assert got == {
        "exec": "EPERM",
        "fork": "EPERM",
        "signal its parent": "EPERM",
        "signal itself": "allowed",
        "chmod": "EPERM",
        "symlink": "EPERM",
        "write a new file": "EPERM",
        "a socket": "EPERM",
        "read a file": "allowed",
    }
    assert not (tmp_path / "new").exists()


def test_a_model_server_keeps_its_network_and_files_and_loses_the_rest(tmp_path: Path) -> None:
    got = attempts("server", tmp_path)
    assert got == {
        "exec": "EPERM",
        "fork": "EPERM",
        "signal its parent": "EPERM",
        "signal itself": "allowed",
        "chmod": "EPERM",
        "symlink": "EPERM",
        "write a new file": "allowed",  # its shadow ledger, its acknowledgements
        "a socket": "allowed",  # its registry and trace store connections
        "read a file": "allowed",
    }


def test_a_policy_refuses_limits_that_could_not_hold() -> None:
    with pytest.raises(ValueError, match="address_space_bytes"):
        SandboxPolicy(address_space_bytes=1 << 20)
    with pytest.raises(ValueError, match="open_files"):
        SandboxPolicy(open_files=3)
