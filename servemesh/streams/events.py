"""An input event's fields, checked: what it asks to score, or why it is poison.

An event is a stream entry with these fields (bytes in Redis, UTF-8):

    entity    the ids it scores: `user-42` (a model of one entity) or `user=u-1,merchant=m-3`
    features  optional: JSON, the values to write into the view first, a whole row
              (`{"f00": 0.1, ...}` for a model of one view; `{"view": {...}}` to name it)
    ts        optional: the features' event time, ms since the Unix epoch (default: now)

Anything else in an entry is kept out of the prediction. An event that cannot be read is
poison: it goes to the dead-letter stream with the reason, never to the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from servemesh.streams.keys import text

MAX_ID_CHARS = 256
MAX_FEATURES = 4096


class Poison(ValueError):
    """The event cannot be scored as sent; the message is the dead-letter reason."""


@dataclass(frozen=True)
class Event:
    id: str
    # A bare id (the model's one entity), or ids by entity name.
    entity: str | dict[str, str]
    # View -> feature -> value; empty: nothing to write first.
    features: dict[str, dict[str, float]] = field(default_factory=dict)
    event_time_ms: int = 0

    @property
    def label(self) -> str:
        if isinstance(self.entity, str):
            return self.entity
        return ",".join(f"{k}={v}" for k, v in self.entity.items())


def _check_id(what: str, value: str) -> str:
    value = value.strip()
    if not value:
        raise Poison(f"{what}: empty")
    if len(value) > MAX_ID_CHARS:
        raise Poison(f"{what}: longer than {MAX_ID_CHARS} characters")
    if any(ord(c) < 32 for c in value):
        raise Poison(f"{what}: holds control characters")
    return value


def _entity(raw: str) -> str | dict[str, str]:
    if "=" not in raw:
        return _check_id("entity", raw)
    ids: dict[str, str] = {}
    for part in raw.split(","):
        name, sep, value = part.partition("=")
        if not sep:
            raise Poison(f"entity: {raw[:60]!r}: give name=id[,name=id]")
        ids[_check_id("entity name", name)] = _check_id(f"entity {name.strip()!r}", value)
    return ids


def _number(view: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Poison(f"features.{name}: {str(value)[:40]!r} is not a number")
    number = float(value)
    if not math.isfinite(number):
        raise Poison(f"features.{name}: not finite")
    return number


def _features(raw: str, views: list[str]) -> dict[str, dict[str, float]]:
    try:
        given = json.loads(raw)
    except ValueError:
        raise Poison("features: not JSON") from None
    if not isinstance(given, dict) or not given:
        raise Poison("features: give a JSON object of feature values")
    if all(not isinstance(v, dict) for v in given.values()):
        if len(views) != 1:
            raise Poison(f"features: the model reads views {views}: name the view of each value")
        given = {views[0]: given}
    found: dict[str, dict[str, float]] = {}
    for view, values in given.items():
        if view not in views:
            raise Poison(f"features: {str(view)[:40]!r} is not a view the model reads: {views}")
        if not isinstance(values, dict) or not values or len(values) > MAX_FEATURES:
            raise Poison(f"features.{view}: give an object of 1 to {MAX_FEATURES} values")
        found[view] = {str(k): _number(view, str(k), v) for k, v in values.items()}
    return found


def parse_event(
    entry_id: str, fields: Mapping[bytes | str, bytes | str], views: list[str], now_ms: int
) -> Event:
    """The event of one stream entry, or Poison naming what is wrong with it."""
    decoded = {text(k): text(v) for k, v in fields.items()}
    raw_entity = decoded.get("entity")
    if raw_entity is None:
        raise Poison("entity: missing (give the ids the event scores)")
    entity = _entity(raw_entity)
    features = _features(decoded["features"], views) if "features" in decoded else {}
    event_ms = now_ms
    if "ts" in decoded:
        try:
            event_ms = int(decoded["ts"])
        except ValueError:
            raise Poison(f"ts: {decoded['ts'][:40]!r} is not ms since the Unix epoch") from None
        if event_ms <= 0 or event_ms > now_ms + 60_000:
            raise Poison("ts: not a time up to a minute from now")
    return Event(id=entry_id, entity=entity, features=features, event_time_ms=event_ms)
