"""A sandboxed model process that attacks instead of computing (tests/sandbox only).

It speaks the child's protocol (servemesh.sandbox.child) and confines itself the same way
(`confine`), then runs arbitrary Python: more than any model file could, so whatever it
cannot do, a model cannot either. Each `run` names its attack in the `attack` input; the
answer's `found` output is what it got: bytes it read (for the caller to search), or 1/0
for "the call went through".
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import sys
import time

import numpy as np

from servemesh.sandbox import SandboxPolicy, confine
from servemesh.sandbox.frames import Frame, FrameReader, PeerGone, write_frame

MARKER = b"sm-test-" + b"secret-"  # built at run time; the caller's secret starts with it
FOUND_BYTES = 4096
SIGNATURE = {
    "inputs": [{"name": "attack", "datatype": "INT64", "shape": [-1, 1]}],
    "outputs": [{"name": "found", "datatype": "UINT8", "shape": [-1, FOUND_BYTES]}],
}


def scan_memory() -> bytes:
    """What follows the marker anywhere in this process's readable memory (read in place,
    as a model with a read primitive would: /proc/self/mem is closed to a process that is
    not dumpable)."""
    found = bytearray()
    with open("/proc/self/maps") as maps:
        regions = [line.split() for line in maps]
    for fields in regions:
        span, perms = fields[:2]
        name = fields[5] if len(fields) > 5 else ""
        if not perms.startswith("r") or name in ("[vvar]", "[vvar_vclock]", "[vsyscall]"):
            continue
        start, end = (int(x, 16) for x in span.split("-"))
        if end - start > 1 << 28:
            continue
        chunk = ctypes.string_at(start, end - start)
        for match in re.finditer(re.escape(MARKER), chunk):
            found += chunk[match.start() : match.start() + 64] + b"\n"
    return bytes(found)


def read(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def attack(code: int, argv: list[str]) -> bytes:
    parent = os.getppid()
    if code == 1:  # everything it can see of its own process
        return read("/proc/self/environ") + read("/proc/self/cmdline") + scan_memory()
    if code == 2:  # its caller's environment
        return read(f"/proc/{parent}/environ")
    if code == 3:  # the secret's file, by path
        return read(argv[0])
    if code == 4:  # a new file
        try:
            with open(argv[1], "w") as handle:
                handle.write("written")
            return b"\x01"
        except OSError:
            return b"\x00"
    if code == 5:  # the network
        with socket.create_connection(("127.0.0.1", int(argv[2])), timeout=2):
            return b"\x01"
    if code == 6:  # another program
        os.execv("/bin/true", ["true"])
    if code == 7:  # a new process
        return b"\x01" if os.fork() else b""
    if code == 8:  # its caller
        os.kill(parent, signal.SIGTERM)
        return b"\x01"
    if code == 9:  # a crash
        ctypes.string_at(0)
    if code == 10:  # a hang
        time.sleep(3600)
    return b""


def main() -> int:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    reader = FrameReader(0, 1 << 30)
    first = reader.read()
    confine(SandboxPolicy(**first.header["policy"]))
    write_frame(replies, Frame({"ok": True, "format": "torchscript", "signature": SIGNATURE}))
    argv = sys.argv[1:]
    while True:
        try:
            frame = reader.read()
        except PeerGone:
            return 0
        code = int(frame.arrays["attack"].reshape(-1)[0])
        got = attack(code, argv)[:FOUND_BYTES]
        found = np.zeros((1, FOUND_BYTES), dtype=np.uint8)
        found[0, : len(got)] = np.frombuffer(got, dtype=np.uint8)
        write_frame(replies, Frame({"ok": True}, {"found": found}))


if __name__ == "__main__":
    sys.exit(main())
