"""The trace store without a mesh: lookups, the waterfall's order, the slowest listing,
and retention by age and by size on an injected clock."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from servemesh.tracestore.store import SpanRecord, TraceStore
from servemesh.tracestore.waterfall import waterfall, waterfall_rows

MS = 1_000_000
T0 = 1_700_000_000_000_000_000


class Clock:
    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


def span(
    trace: str,
    sid: str,
    parent: str | None,
    name: str,
    start_ms: float,
    ms: float,
    service: str = "gateway",
    **extra: Any,
) -> SpanRecord:
    return SpanRecord(
        trace_id=trace * 32,
        span_id=sid * 16,
        parent_id=parent * 16 if parent else None,
        name=name,
        service=service,
        start_ns=T0 + int(start_ms * MS),
        end_ns=T0 + int((start_ms + ms) * MS),
        **extra,
    )


def request_trace(trace: str, total_ms: float, request_id: str) -> list[SpanRecord]:
    """edge -> gateway -> model, and the model's batch (a trace of its own) linked in."""
    batch_trace = chr(ord(trace) + 1)
    return [
        span(trace, "1", "f", "ingress", 0, total_ms, service="envoy-edge"),
        span(trace, "2", "1", "Predict", 1, total_ms - 2, request_id=request_id, model="fraud"),
        span(trace, "3", "2", "ModelInfer", 2, total_ms - 4, service="model"),
        span(
            batch_trace,
            "4",
            None,
            "batch",
            3,
            total_ms - 6,
            service="model",
            links=((trace * 32, "3" * 16),),
        ),
    ]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[TraceStore]:
    opened = TraceStore(tmp_path / "traces.db", clock=clock)
    yield opened
    opened.close()


def test_a_request_id_finds_its_trace_and_the_batch_linked_into_it(store: TraceStore) -> None:
    store.add(request_trace("a", 10, "req-a"))
    trace_id = store.find("req-a")
    assert trace_id == "a" * 32
    assert store.find(trace_id) == trace_id  # a trace id finds itself
    assert store.find("nobody") is None
    names = [s.name for s in store.trace(trace_id)]
    assert names == ["ingress", "Predict", "ModelInfer", "batch"]
    batch = store.trace(trace_id)[-1]
    assert batch.trace_id == "b" * 32 and batch.links == (("a" * 32, "3" * 16),)


def test_the_waterfall_puts_children_under_parents_and_the_batch_under_its_request(
    store: TraceStore,
) -> None:
    store.add(request_trace("a", 10, "req-a"))
    # A second child of the gateway that started earlier than ModelInfer: siblings by start.
    store.add([span("a", "5", "2", "GetFeatures", 1.5, 0.3, service="feature")])
    rows = waterfall_rows(store.trace("a" * 32))
    assert [(r.span.name, r.depth, r.linked) for r in rows] == [
        ("ingress", 0, False),
        ("Predict", 1, False),
        ("GetFeatures", 2, False),
        ("ModelInfer", 2, False),
        ("batch", 3, True),
    ]
    console = Console(width=160, record=True)
    console.print(waterfall(store.trace("a" * 32)))
    text = console.export_text()
    assert "envoy-edge" in text and "↪ batch" in text and "10.00" in text


def test_slowest_lists_traces_by_root_duration_without_batch_traces(
    store: TraceStore,
) -> None:
    store.add(request_trace("a", 10, "req-a"))
    store.add(request_trace("c", 30, "req-c"))
    store.add(request_trace("e", 20, "req-e"))
    store.add([span("e", "9", "2", "GetFeatures", 2, 1, status="error")])
    found = store.slowest(10)
    assert [s.request_id for s in found] == ["req-c", "req-e", "req-a"]
    assert [round(s.duration_ns / MS) for s in found] == [30, 20, 10]
    assert [s.status for s in found] == ["ok", "error", "ok"]
    assert {s.root_name for s in found} == {"ingress"}  # never a batch's own trace
    assert [s.request_id for s in store.slowest(1)] == ["req-c"]
    assert store.slowest(10, since_ns=T0 + 1) == []  # all started at T0


def test_retention_deletes_spans_older_than_max_age(store: TraceStore, clock: Clock) -> None:
    store.add(request_trace("a", 10, "req-a"))
    clock.now += 3600 * 10**9
    store.add(request_trace("c", 10, "req-c"))
    clock.now += 1800 * 10**9
    deleted = store.prune(max_age_s=3600, max_bytes=1 << 30)
    assert deleted == 4
    assert store.find("req-a") is None
    assert store.find("req-c") == "c" * 32
    assert store.count() == 4


def test_retention_by_size_drops_the_oldest_traces_first(store: TraceStore, clock: Clock) -> None:
    filler = {"payload": "x" * 4000}
    for i in range(60):
        clock.now += 10**9
        trace = f"{i:032x}"
        store.add(
            [
                SpanRecord(
                    trace_id=trace,
                    span_id=f"{j:016x}",
                    parent_id=None,
                    name="Predict",
                    service="gateway",
                    start_ns=clock.now,
                    end_ns=clock.now + MS,
                    attributes=filler,
                    request_id=f"req-{i}",
                )
                for j in range(5)
            ]
        )
    before = store.size_bytes()
    limit = before // 2
    store.prune(max_age_s=10**9, max_bytes=limit)
    assert store.size_bytes() <= limit
    assert store.find("req-0") is None  # the oldest went
    assert store.find("req-59") is not None  # the newest stayed
    kept = [i for i in range(60) if store.find(f"req-{i}") is not None]
    assert kept == list(range(kept[0], 60))  # what went is a prefix in arrival order


def test_latest_lists_the_traces_started_last_newest_first(store: TraceStore) -> None:
    store.add(request_trace("a", 10, "req-a"))
    store.add([span("c", "1", "f", "ingress", 5, 3, service="envoy-edge", request_id="req-c")])
    store.add([span("e", "1", "f", "ingress", 2, 40, service="envoy-edge", request_id="req-e")])
    assert [s.request_id for s in store.latest(10)] == ["req-c", "req-e", "req-a"]
    assert [s.request_id for s in store.latest(2)] == ["req-c", "req-e"]
    assert [s.request_id for s in store.latest(10, since_ns=T0 + 3 * MS)] == ["req-c"]


def test_trace_o_json_prints_the_waterfall_the_slowest_and_the_hops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from servemesh.cli import main
    from servemesh.tracestore.receiver import store_path

    state = tmp_path / "state"
    path = store_path(state)
    path.parent.mkdir(parents=True)
    written = TraceStore(path)
    written.add(request_trace("a", 10, "req-a"))
    written.add(request_trace("c", 30, "req-c"))
    written.close()
    where = ["--state-dir", str(state), "-o", "json"]

    assert main(["trace", "req-a", *where]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["trace_id"] == "a" * 32 and shown["ms"] == 10.0
    assert [(s["span"], s["depth"], s["linked"]) for s in shown["spans"]] == [
        ("ingress", 0, False),
        ("Predict", 1, False),
        ("ModelInfer", 2, False),
        ("batch", 3, True),
    ]
    assert shown["spans"][1]["start_ms"] == 1.0 and shown["spans"][1]["status"] == "ok"

    # The spans started at T0, long ago: a --since that reaches back to them.
    assert main(["trace", "--slowest", "5", "--since", "9999d", *where]) == 0
    slowest = json.loads(capsys.readouterr().out)
    assert [(s["request_id"], s["root_ms"], s["status"]) for s in slowest] == [
        ("req-c", 30.0, "ok"),
        ("req-a", 10.0, "ok"),
    ]

    assert main(["trace", "--hops", "5", "--since", "9999d", *where]) == 0
    (group,) = json.loads(capsys.readouterr().out)
    assert group["root"] == "envoy-edge ingress" and group["traces"] == 2
    assert group["median_ms"] == 20.0 and group["hops"][0]["traces"] == 2
