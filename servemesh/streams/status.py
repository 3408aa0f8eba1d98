"""What `servemesh stream status` shows of each stream: its lag, read from Redis, and its
consumer's counters and rate (the stats hash it refreshes every second)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from servemesh.spec import ResolvedSpec, StreamSpec
from servemesh.streams.consumer import stream_client
from servemesh.streams.keys import StreamKeys, text
from servemesh.streams.metrics import Lag, read_lag

# A consumer whose stats are older than this is shown as not running.
STALE_STATS_S = 5.0


@dataclass(frozen=True)
class StreamStatus:
    name: str
    model: str
    mode: str
    input: str
    output: str
    dead_letter: str
    lag: Lag | None
    stats: dict[str, str]

    @property
    def consumer_running(self) -> bool:
        updated = int(self.stats.get("updated_ms") or 0)
        return updated > 0 and time.time() * 1000 - updated < STALE_STATS_S * 1000

    def as_dict(self) -> dict[str, Any]:
        found = asdict(self)
        found["consumer_running"] = self.consumer_running
        return found


async def stream_status(spec: ResolvedSpec, stream: StreamSpec) -> StreamStatus:
    keys = StreamKeys.of(stream)
    client = stream_client(spec, stream)
    try:
        lag = await read_lag(client, keys)
        raw = await client.hgetall(keys.stats)
    finally:
        await client.aclose()
    return StreamStatus(
        name=stream.name,
        model=stream.model,
        mode=stream.mode,
        input=keys.input,
        output=keys.output,
        dead_letter=keys.dead_letter,
        lag=lag,
        stats={text(k): text(v) for k, v in raw.items()},
    )
