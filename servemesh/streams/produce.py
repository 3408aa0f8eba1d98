"""A producer at a fixed rate, and what came out: for the benchmark and the chaos drill.

`produce` adds events (entity ids cycling through the demo's) at `rate` a second for
`seconds`, in ticks of TICK_S (one pipelined XADD batch each), and answers their ids;
`delivery` reads the output stream back: per input id how many outputs it has, and the
event-to-prediction latency of each (the output id's ms less the input id's).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from servemesh.streams.keys import StreamKeys, id_ms, text

TICK_S = 0.01


def produce(
    client: Any,
    keys: StreamKeys,
    rate: float,
    seconds: float,
    entities: int,
    stop: threading.Event | None = None,
) -> list[str]:
    """Events at `rate`/s for `seconds` (bounded: rate x seconds events at most)."""
    total = int(rate * seconds)
    ids: list[str] = []
    start = time.monotonic()
    sent = 0
    while sent < total and not (stop is not None and stop.is_set()):
        due = min(total, int((time.monotonic() - start) * rate) + 1)
        if due > sent:
            pipe = client.pipeline(transaction=False)
            for i in range(sent, due):
                pipe.xadd(keys.input, {"entity": f"user-{i % max(1, entities)}"})
            ids += [text(i) for i in pipe.execute()]
            sent = due
        wait = start + sent / rate - time.monotonic()
        if wait > 0:
            (stop or threading.Event()).wait(min(wait, TICK_S))
    return ids


@dataclass
class Delivery:
    sent: int
    outputs: Counter[str] = field(default_factory=Counter)
    latencies_ms: list[int] = field(default_factory=list)
    last_output_ms: int = 0

    @property
    def missing(self) -> int:
        return self.sent - len(self.outputs)

    @property
    def duplicated(self) -> int:
        return sum(1 for n in self.outputs.values() if n > 1)

    @property
    def exactly_once(self) -> bool:
        return self.missing == 0 and self.duplicated == 0


def delivery(client: Any, keys: StreamKeys, ids: list[str], page: int = 10_000) -> Delivery:
    """How the events `ids` came out (outputs of other events are left out)."""
    wanted = set(ids)
    found = Delivery(sent=len(ids))
    start = ids[0] if ids else "-"
    while ids:
        entries = client.xrange(keys.output, min=start, count=page)
        for out_id, fields in entries:
            event = text(fields.get(b"event", b""))
            if event in wanted:
                found.outputs[event] += 1
                found.latencies_ms.append(id_ms(out_id) - id_ms(event))
                found.last_output_ms = max(found.last_output_ms, id_ms(out_id))
        if len(entries) < page:
            break
        start = "(" + text(entries[-1][0])
    return found
