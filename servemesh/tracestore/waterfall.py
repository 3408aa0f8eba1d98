"""A trace as a waterfall (one row per span, children under their parent) and the slowest
traces as a table, drawn with rich."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table
from rich.text import Text

from servemesh.tracestore.store import SpanRecord, TraceSummary

BAR_WIDTH = 40


@dataclass(frozen=True)
class Row:
    """One span in waterfall order, with its depth in the tree."""

    span: SpanRecord
    depth: int
    linked: bool  # shown under a span it links to, not its parent (a batch)


def waterfall_rows(spans: Sequence[SpanRecord]) -> list[Row]:
    """Spans in tree order: each under its parent (or, for a span of another trace linked
    into this one, under the span it links to), siblings by start time. Spans whose parent
    is not stored are roots."""
    by_id = {s.span_id: s for s in spans}
    trace_ids = {s.trace_id for s in spans if not s.links}
    children: dict[str | None, list[tuple[SpanRecord, bool]]] = {}
    for span in spans:
        anchor = span.parent_id if span.parent_id in by_id else None
        linked = False
        if anchor is None and span.links:
            targets = [sid for tid, sid in span.links if tid in trace_ids and sid in by_id]
            if targets:
                anchor, linked = targets[0], True
        children.setdefault(anchor, []).append((span, linked))
    rows: list[Row] = []

    def walk(parent: str | None, depth: int) -> None:
        for span, linked in sorted(children.get(parent, []), key=lambda c: c[0].start_ns):
            rows.append(Row(span, depth, linked))
            walk(span.span_id, depth + 1)

    walk(None, 0)
    return rows


def _bar(span: SpanRecord, t0: int, total: int, width: int) -> Text:
    start = round((span.start_ns - t0) / total * width) if total else 0
    length = max(1, round(span.duration_ns / total * width)) if total else 1
    start = min(max(start, 0), width - 1)
    length = min(length, width - start)
    style = "red" if span.status == "error" else "cyan"
    return Text(" " * start) + Text("█" * length, style=style)


def _status(span: SpanRecord) -> str:
    # Unset is how a span says "nothing went wrong" (OpenTelemetry sets ok rarely).
    return "error" if span.status == "error" else "ok"


def waterfall_data(spans: Sequence[SpanRecord]) -> dict[str, Any]:
    """What the waterfall shows, as data: the trace, its length, and each span in
    waterfall order (its depth in the tree, whether it is linked in, its start offset)."""
    rows = waterfall_rows(spans)
    t0 = min((s.start_ns for s in spans), default=0)
    t1 = max((s.end_ns for s in spans), default=0)
    return {
        "trace_id": next((r.span.trace_id for r in rows if not r.linked), ""),
        "ms": max(t1 - t0, 1) / 1e6,
        "spans": [
            {
                "service": row.span.who,
                "span": row.span.name,
                "depth": row.depth,
                "linked": row.linked,
                "start_ms": (row.span.start_ns - t0) / 1e6,
                "ms": row.span.duration_ns / 1e6,
                "status": _status(row.span),
                "message": row.span.message,
            }
            for row in rows
        ],
    }


def waterfall(spans: Sequence[SpanRecord], width: int = BAR_WIDTH) -> Table:
    """The trace's waterfall: service, span, start offset, duration, bar, status."""
    rows = waterfall_rows(spans)
    t0 = min((s.start_ns for s in spans), default=0)
    t1 = max((s.end_ns for s in spans), default=0)
    total = max(t1 - t0, 1)
    trace_id = next((r.span.trace_id for r in rows if not r.linked), "")
    table = Table(title=f"trace {trace_id}  ({total / 1e6:.2f} ms)", title_justify="left")
    table.add_column("service")
    table.add_column("span")
    table.add_column("start ms", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("", no_wrap=True)
    table.add_column("status")
    for row in rows:
        span = row.span
        name = "  " * row.depth + ("↪ " if row.linked else "") + span.name
        status = _status(span)
        if span.message:
            status = f"{status}: {span.message}"
        table.add_row(
            span.who,
            name,
            f"{(span.start_ns - t0) / 1e6:.2f}",
            f"{span.duration_ns / 1e6:.2f}",
            _bar(span, t0, total, width),
            Text(status, style="red" if span.status == "error" else ""),
        )
    return table


def slowest_data(summaries: Sequence[TraceSummary]) -> list[dict[str, Any]]:
    """The slowest table's rows, as data."""
    return [
        {
            "root_ms": s.duration_ns / 1e6,
            "trace_id": s.trace_id,
            "request_id": s.request_id,
            "model": s.model,
            "root_service": s.root_service,
            "root_span": s.root_name,
            "status": s.status,
        }
        for s in summaries
    ]


def slowest_table(summaries: Sequence[TraceSummary], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("root ms", justify="right")
    table.add_column("trace id")
    table.add_column("request id")
    table.add_column("model")
    table.add_column("root span")
    table.add_column("status")
    for s in summaries:
        table.add_row(
            f"{s.duration_ns / 1e6:.2f}",
            s.trace_id,
            s.request_id or "",
            s.model or "",
            f"{s.root_service} {s.root_name}",
            Text(s.status, style="red" if s.errors else "green"),
        )
    return table
