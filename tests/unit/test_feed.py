"""The change feed's pure parts: what a written key means to a gateway's cache, and how a
gateway judges whether the feed may be trusted and an answer made meanwhile kept."""

from __future__ import annotations

from servemesh.services.feature.changes import PING_NAME, KeyMeaning, meaning_of
from servemesh.services.gateway.feed import MISSED_HEARTBEATS, FeedState
from servemesh_api.feature.v1 import feature_pb2


def test_keys_mean_rows_views_models_or_nothing() -> None:
    assert meaning_of("fs:user@3:user-7", "fs") == KeyMeaning(row=("user", 3, "user-7"))
    assert meaning_of("fs:user@3:a:b", "fs") == KeyMeaning(row=("user", 3, "a:b"))
    assert meaning_of("fs:user:current", "fs") == KeyMeaning(view="user")
    assert meaning_of(f"fs:{PING_NAME}", "fs") == KeyMeaning(ping=True)
    assert meaning_of("fs.tiers:fraud:flush", "fs") == KeyMeaning(model="fraud")
    assert meaning_of("fs.scores:fraud:v2:current", "fs") == KeyMeaning(model="fraud")
    # leases, sequences, a run's own rows, another prefix's keys: nothing cached hangs on them
    for key in ("fs:user:load", "fs:user:seq", "fs:user@x:u", "fs.scores:fraud:v2@4:u1",
                "other:user@3:u", "fs:user"):  # fmt: skip
        assert meaning_of(key, "fs") is None, key


def _row(entity: str) -> feature_pb2.Change:
    return feature_pb2.Change(row=feature_pb2.RowChange(view="user", entity_id=entity))


def test_an_answer_is_kept_only_when_nothing_it_was_made_from_changed() -> None:
    now = [0.0]
    feed = FeedState(clock=lambda: now[0])
    assert not feed.fresh()  # not before its first message
    feed.started(heartbeat_ms=250)
    mark = feed.mark()
    feed.heard([_row("user-8")])
    assert feed.unchanged_since(mark, "fraud", "user", ["user-7"])
    feed.heard([_row("user-7")])
    assert not feed.unchanged_since(mark, "fraud", "user", ["user-7"])
    later = feed.mark()
    feed.heard([feature_pb2.Change(model="other")])
    assert feed.unchanged_since(later, "fraud", "user", ["user-7"])
    feed.heard([feature_pb2.Change(model="fraud")])
    assert not feed.unchanged_since(later, "fraud", "user", ["user-7"])
    last = feed.mark()
    feed.heard([feature_pb2.Change(view="user")])
    assert not feed.unchanged_since(last, "fraud", "user", ["user-1"])


def test_a_silent_or_broken_feed_is_not_trusted() -> None:
    now = [0.0]
    feed = FeedState(clock=lambda: now[0])
    feed.started(heartbeat_ms=250)
    mark = feed.mark()
    now[0] = MISSED_HEARTBEATS * 0.25 + 0.01  # heartbeats missed: silent
    assert not feed.fresh()
    assert not feed.unchanged_since(mark, "fraud", "user", ["user-7"])
    feed.heard([])  # a heartbeat: trusted again
    assert feed.fresh() and feed.unchanged_since(mark, "fraud", "user", ["user-7"])
    feed.broke()
    assert not feed.fresh()
    feed.started(heartbeat_ms=250)  # a new stream: what began on the old one is not kept
    assert feed.fresh() and not feed.unchanged_since(mark, "fraud", "user", ["user-7"])
