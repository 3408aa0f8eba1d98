"""Where a trace's time goes between its spans, summed over many traces (`servemesh trace
--hops N`).

A waterfall shows one call; the time between spans (a proxy forwarding, a server taking
a request off the wire, a client getting its answer) is what it leaves to the eye. Here
each trace is cut into hops, each named by the spans around it:

- `A → B starts`: from a span's start to its first child's (B);
- `between B and C`: from one child's end to the next child's start;
- `B ends → A ends`: from its last child's end to its own end;
- `inside A`: the whole of a span with no child spans (its own work);
- `inside B (overlapping)`: a child that starts before an earlier one ended (a hedge,
  calls made side by side) or ends after its parent (a copy sent on), for the part of it
  no earlier hop holds; it is not cut further.

The hops of one trace add up to its root span. Spans of other traces linked into it (a
batch) are left out: they serve several traces at once. Hops are named by service, not
instance, so that the replicas of a service add up to one row.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rich.table import Table

from servemesh.contract.percentiles import percentile
from servemesh.tracestore.store import SpanRecord


@dataclass(frozen=True)
class Hop:
    """One stretch of one trace between two span boundaries."""

    label: str
    ms: float


def _who(span: SpanRecord) -> str:
    """The span's service and its short name: the method without its package."""
    service, slash, method = span.name.partition("/")
    short = f"{service.rsplit('.', 1)[-1]}/{method}" if slash else span.name
    return f"{span.service} {short}"


def root_of(spans: Sequence[SpanRecord]) -> SpanRecord | None:
    """The trace's first span whose parent is not stored (a linked batch is no root)."""
    by_id = {s.span_id: s for s in spans}
    roots = [s for s in spans if s.parent_id not in by_id and not s.links]
    return min(roots, key=lambda s: s.start_ns) if roots else None


def trace_hops(spans: Sequence[SpanRecord]) -> list[Hop]:
    """The hops of one trace, in the order a walk of its tree meets them."""
    root = root_of(spans)
    return [] if root is None else _cut(root, spans)


def _cut(root: SpanRecord, spans: Sequence[SpanRecord]) -> list[Hop]:
    """The hops of the trace `root` roots (`trace_hops`, its root already found)."""
    by_id = {s.span_id: s for s in spans}
    children: dict[str, list[SpanRecord]] = {}
    for span in spans:
        if span.trace_id == root.trace_id and span.parent_id in by_id:
            children.setdefault(span.parent_id, []).append(span)
    hops: list[Hop] = []

    def add(label: str, ns: int) -> None:
        hops.append(Hop(label, max(ns, 0) / 1e6))

    def walk(span: SpanRecord) -> None:
        kids = sorted(children.get(span.span_id, []), key=lambda s: s.start_ns)
        if not kids:
            add(f"inside {_who(span)}", span.duration_ns)
            return
        # `reached`: how far into `span` the hops so far account for. A child that starts
        # before it (a hedge, calls made side by side) or ends after its parent (a copy
        # sent on) counts only for the time no earlier hop holds, and is not cut further.
        reached = span.start_ns
        for index, kid in enumerate(kids):
            if kid.start_ns >= reached:
                gap = kid.start_ns - reached
                if index == 0:
                    add(f"{_who(span)} → {_who(kid)} starts", gap)
                else:
                    add(f"between {_who(kids[index - 1])} and {_who(kid)}", gap)
            if kid.start_ns >= reached and kid.end_ns <= span.end_ns:
                walk(kid)
            else:
                until = min(kid.end_ns, span.end_ns)
                add(f"inside {_who(kid)} (overlapping)", until - max(reached, kid.start_ns))
            reached = max(reached, min(kid.end_ns, span.end_ns))
        add(f"{_who(kids[-1])} ends → {_who(span)} ends", span.end_ns - reached)

    walk(root)
    return hops


@dataclass(frozen=True)
class HopSummary:
    """One hop over many traces."""

    label: str
    traces: int
    median_ms: float
    p90_ms: float
    max_ms: float
    share: float  # median_ms / the median root span


def summarize_hops(traces: Sequence[Sequence[SpanRecord]]) -> tuple[list[HopSummary], float]:
    """Each hop's median, p90 and max over the traces that have it, in the order first
    met; and the median root span (ms) they are shares of."""
    return _summarize(_rooted(traces))


# A trace's spans with its root span.
Rooted = tuple[SpanRecord, Sequence[SpanRecord]]


def _rooted(traces: Sequence[Sequence[SpanRecord]]) -> list[Rooted]:
    """Each trace with its root, those without one left out."""
    return [(root, spans) for spans in traces if (root := root_of(spans)) is not None]


def _summarize(rooted: Sequence[Rooted]) -> tuple[list[HopSummary], float]:
    found: dict[str, list[float]] = {}
    totals: list[float] = []
    for root, spans in rooted:
        hops = _cut(root, spans)
        totals.append(root.duration_ns / 1e6)
        # A hop met twice in one trace (a retry, two calls alike) counts once, summed.
        mine: dict[str, float] = {}
        for hop in hops:
            mine[hop.label] = mine.get(hop.label, 0.0) + hop.ms
        for label, ms in mine.items():
            found.setdefault(label, []).append(ms)
    if not totals:
        return [], 0.0
    total = statistics.median(totals)
    rows = []
    for label, values in found.items():
        ranked = sorted(values)
        median = statistics.median(ranked)
        rows.append(
            HopSummary(
                label=label,
                traces=len(ranked),
                median_ms=round(median, 3),
                p90_ms=round(percentile(ranked, 90), 3),
                max_ms=round(ranked[-1], 3),
                share=round(median / total, 3) if total else 0.0,
            )
        )
    return rows, round(total, 3)


@dataclass(frozen=True)
class HopGroup:
    """The traces of one kind (their root span: an edge Predict, a health check) and their
    hops."""

    root: str
    traces: int
    median_ms: float  # the median root span
    hops: list[HopSummary]


def hop_groups(traces: Sequence[Sequence[SpanRecord]]) -> list[HopGroup]:
    """One group per kind of trace, the kind with the most traces first."""
    kinds: dict[str, list[Rooted]] = {}
    for root, spans in _rooted(traces):
        kinds.setdefault(_who(root), []).append((root, spans))
    groups = []
    for kind, group in sorted(kinds.items(), key=lambda item: -len(item[1])):
        rows, total = _summarize(group)
        groups.append(HopGroup(kind, len(group), total, rows))
    return groups


def hops_tables(traces: Sequence[Sequence[SpanRecord]], title: str) -> list[Table]:
    """One table per kind of trace (its root span: an edge Predict, a health check), the
    kind with the most traces first."""
    tables = []
    for group in hop_groups(traces):
        table = Table(
            title=f"{title}: {group.traces} rooted at {group.root}, "
            f"the median {group.median_ms:.2f} ms",
            title_justify="left",
        )
        table.add_column("hop")
        table.add_column("traces", justify="right")
        table.add_column("median ms", justify="right")
        table.add_column("p90 ms", justify="right")
        table.add_column("max ms", justify="right")
        table.add_column("of the trace", justify="right")
        for row in group.hops:
            table.add_row(
                row.label,
                str(row.traces),
                f"{row.median_ms:.2f}",
                f"{row.p90_ms:.2f}",
                f"{row.max_ms:.2f}",
                f"{row.share:.0%}",
            )
        tables.append(table)
    return tables
