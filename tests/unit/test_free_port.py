"""free_port: a port two callers pick at once goes to one of them only (each claims what
it picks for RESERVATION_S), a claim older than that is taken over, and expired claims
are swept."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

import pytest

from servemesh.spec import RESERVATION_S, free_port
from servemesh.spec import network as spec_module


def claim_file(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"servemesh-ports-{os.getuid()}" / str(port)


def test_two_callers_walking_the_same_ports_never_get_the_same_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two callers whose random walks are the same: the worst case of two processes.
    monkeypatch.setattr(spec_module, "_PICKER", random.Random(1234))
    first = free_port("127.0.0.1")
    monkeypatch.setattr(spec_module, "_PICKER", random.Random(1234))
    second = free_port("127.0.0.1")
    assert first != second
    # Nobody bound the first: without its claim it would have been handed out again.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", first))
    assert claim_file(first).read_text().strip() == str(os.getpid())


def test_a_stale_claim_is_taken_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec_module, "_PICKER", random.Random(99))
    port = free_port("127.0.0.1")
    old = time.time() - RESERVATION_S - 1
    os.utime(claim_file(port), (old, old))
    monkeypatch.setattr(spec_module, "_PICKER", random.Random(99))
    assert free_port("127.0.0.1") == port


def test_expired_claims_are_swept(monkeypatch: pytest.MonkeyPatch) -> None:
    folder = claim_file(1).parent
    folder.mkdir(mode=0o700, exist_ok=True)
    stale, fresh = folder / "1", folder / "2"
    stale.write_text("1\n")
    fresh.write_text("1\n")
    old = time.time() - RESERVATION_S - 1
    os.utime(stale, (old, old))
    monkeypatch.setattr(spec_module, "_last_sweep", [0.0])  # due now
    free_port("127.0.0.1")
    assert not stale.exists() and fresh.exists()
    fresh.unlink()
