"""A process's memory from /proc: resident (VmRSS) and proportional (Pss), on real processes.
`bench predict` reports both for the idle mesh: RSS summed over processes counts every
shared page once per process that maps it, Pss counts it once in all."""

from __future__ import annotations

import os
import subprocess
import sys

from servemesh.observe.cpu import descendants, pss_bytes, rss_bytes


def test_a_process_s_proportional_set_is_within_its_resident_set() -> None:
    pss, rss = pss_bytes(os.getpid()), rss_bytes(os.getpid())
    assert pss is not None and rss is not None
    assert 0 < pss <= rss


def test_pages_two_processes_share_are_counted_in_part() -> None:
    # A second interpreter maps the same interpreter and C library: those pages are shared.
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            assert child.stdout.readline() == "ready\n"
            pss, rss = pss_bytes(child.pid), rss_bytes(child.pid)
            assert pss is not None and rss is not None
            assert pss < rss
        finally:
            child.stdin.close()  # its read ends: it exits
            child.wait(timeout=10)
    # Once it is gone: nothing to read, and no error.
    assert pss_bytes(child.pid) is None and rss_bytes(child.pid) is None


def test_descendants_are_children_and_their_children_only() -> None:
    # A child that starts a grandchild, says both PIDs, and waits for its stdin to close.
    code = (
        "import subprocess, sys\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
        " stdin=subprocess.PIPE)\n"
        "print(g.pid, flush=True)\n"
        "sys.stdin.read(); g.stdin.close(); g.wait()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            grandchild = int(child.stdout.readline())
            found = descendants(os.getpid())
            assert child.pid in found and grandchild in found
            assert descendants(child.pid) == [grandchild]
            assert os.getpid() not in found and os.getppid() not in found
        finally:
            child.stdin.close()
            child.wait(timeout=30)
