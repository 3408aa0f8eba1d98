"""The in-flight journal: a model thread's batch is on disk while the model runs, gone after,
and what it costs per batch.

The model here is a plain runner that blocks on a threading.Event the test sets: "the
batch is in the forward pass" is a fact the test waits for, never a sleep."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from servemesh.contract.inflight import SLOT_BYTES, InflightJournal, journal_path, read_inflight
from servemesh.services.model.batching import Batcher, NamedRows, Rows
from servemesh.services.model.batching.batcher import payload_sha256
from servemesh.spec import BatchingSpec
from tests.waiting import wait_until, wait_until_async

pytestmark = pytest.mark.timeout(60)


class HeldModel:
    """Doubles its input; holds each batch until `release` is set."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def run(self, batch: Rows) -> Rows:
        self.entered.set()
        self.release.wait(30)
        assert isinstance(batch, np.ndarray)
        return batch * 2


def test_slots_are_written_and_read_back_and_cleared(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "model-fraud-zone-a-0")
    journal = InflightJournal(path)
    first = journal.slot("fraud", "v1")
    second = journal.slot("fraud", "v2")
    first.begin([("r-1", "ipv4:127.0.0.1:5", "ab" * 32), ('r-"2"', "", "cd" * 32)])
    second.begin([("r-3", "peer", "ef" * 32)])
    found = read_inflight(path)
    assert [(b["model"], b["version"]) for b in found] == [("fraud", "v1"), ("fraud", "v2")]
    assert found[0]["calls"][1] == {"request_id": 'r-"2"', "caller": "", "sha256": "cd" * 32}
    first.end()
    assert [b["version"] for b in read_inflight(path)] == ["v2"]
    # A batch too large for its slot keeps its first calls and says how many it left out.
    second.begin([(f"r-{i}-" + "x" * 100, "peer", "00" * 32) for i in range(200)])
    (big,) = read_inflight(path)
    assert big["more"] > 0 and len(big["calls"]) + big["more"] == 200
    assert path.stat().st_size <= 2 * SLOT_BYTES
    journal.close()  # a deliberate stop: nothing is in flight
    assert not path.exists() and read_inflight(path) == []


def test_a_new_process_of_the_instance_starts_an_empty_journal(tmp_path: Path) -> None:
    path = journal_path(tmp_path, "model-fraud-zone-a-0")
    InflightJournal(path).slot("fraud", "v1").begin([("r-1", "", "00" * 32)])
    InflightJournal(path)  # what a restarted server opens
    assert read_inflight(path) == []


def test_payload_sha256_is_the_input_bytes_in_signature_order() -> None:
    rows = np.arange(6, dtype=np.float32).reshape(1, 6)
    assert payload_sha256(rows) == hashlib.sha256(rows.tobytes()).hexdigest()
    named = NamedRows({"a": rows, "b": np.ones((1, 2), dtype=np.int64)})
    expected = hashlib.sha256(rows.tobytes() + np.ones((1, 2), dtype=np.int64).tobytes())
    assert payload_sha256(named) == expected.hexdigest()


async def test_a_batch_is_in_the_journal_while_the_model_runs_and_gone_after(
    tmp_path: Path,
) -> None:
    path = journal_path(tmp_path, "model-fraud-zone-a-0")
    journal = InflightJournal(path)
    model = HeldModel()
    batcher = Batcher(model, BatchingSpec(max_batch_size=8), name="fraud:v1")
    batcher.journal = journal.slot("fraud", "v1")
    payload = np.full((1, 4), 7.0, dtype=np.float32)
    try:
        answer = batcher.enqueue(payload, time.monotonic() + 30, "req-42", caller="ipv4:1.2.3.4:5")
        await wait_until_async(model.entered.is_set, "the batch to reach the model")
        (batch,) = read_inflight(path)
        assert batch["model"] == "fraud" and batch["version"] == "v1"
        assert batch["calls"] == [
            {
                "request_id": "req-42",
                "caller": "ipv4:1.2.3.4:5",
                "sha256": hashlib.sha256(payload.tobytes()).hexdigest(),
            }
        ]
        model.release.set()
        doubled = await answer
        assert isinstance(doubled, np.ndarray) and doubled.tolist() == (payload * 2).tolist()
        wait_until(lambda: read_inflight(path) == [], "the journal to be cleared")
    finally:
        model.release.set()
        await batcher.close()
        journal.close()


def test_what_the_journal_costs_per_batch(tmp_path: Path) -> None:
    """Hash, format and two pwrites per batch of one small request (the demo model's 64
    features): printed, and bounded far above what it measures (a few microseconds), so a
    busy machine does not make it red."""
    journal = InflightJournal(journal_path(tmp_path, "model-fraud-zone-a-0"))
    slot = journal.slot("fraud", "v1")
    rows = np.random.default_rng(1).random((1, 64), dtype=np.float32)
    request_id = "0f9e3c1a-7b2d-4e5f-8a9b-0c1d2e3f4a5b"
    rounds = 20_000
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(rounds):
            slot.begin([(request_id, "ipv4:127.0.0.1:40000", payload_sha256(rows))])
            slot.end()
        best = min(best, (time.perf_counter() - started) / rounds)
    journal.close()
    print(f"in-flight journal: {best * 1e6:.2f} us per batch of one request")
    assert best < 100e-6
