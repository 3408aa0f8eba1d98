"""Where a stream's state lives in Redis, and what its entry ids mean.

| key | type | what |
| --- | --- | --- |
| `streams:<name>:in` | stream | events, read by the consumer group (`group`) |
| `streams:<name>:out` | stream | one prediction per event, its `event` field the input id |
| `streams:<name>:dead` | stream | poison events, with the `reason` they were refused for |
| `streams:<name>:done:<event id>` | string | the output entry written for that event (a TTL) |
| `streams:<name>:stats` | hash | the consumer's counters and rate, for `servemesh stream status` |

The `done` marker is what makes a redelivery harmless: the output entry and the marker are
written by one script, and a redelivered event whose marker is there writes nothing (it is
acknowledged again). An entry id is `<ms>-<seq>`, ms the Redis server's clock when the
entry was added: the age of a pending event, and the event-to-prediction latency (the
output entry's ms less the input's), are read from ids of one clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from servemesh.spec import StreamSpec


@dataclass(frozen=True)
class StreamKeys:
    name: str
    input: str
    output: str
    dead_letter: str
    group: str

    @classmethod
    def of(cls, spec: StreamSpec) -> StreamKeys:
        return cls(
            name=spec.name,
            input=spec.input_key,
            output=spec.output_key,
            dead_letter=spec.dead_letter_key,
            group=spec.group,
        )

    @property
    def base(self) -> str:
        return f"streams:{self.name}"

    def done(self, event_id: str) -> str:
        return f"{self.base}:done:{event_id}"

    @property
    def stats(self) -> str:
        return f"{self.base}:stats"


def id_ms(entry_id: str | bytes) -> int:
    """The milliseconds part of a stream entry id."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[0])


def text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
