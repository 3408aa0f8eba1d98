"""The store's change feed (FeatureService.WatchChanges), from Redis keyspace events.

A gateway whose cache answers without reading the row (a model's `cache: {freshness:
feed}`) must hear of every write that could change an answer, whoever made it: this
service's WriteFeatures and LoadFeatures, another replica's, a `servemesh batch score --out
redis`, a `servemesh cache flush`. Redis publishes each write to a key as a keyspace event
(`notify-keyspace-events K$`, set by the mesh when it starts its Redis), in the order it
made them; one subscription per replica turns them into Changes for every watcher.

Proof of freshness rides the same channel: the hub writes a ping key every PING_S and
sends a heartbeat to its watchers when that write's own event comes back. Redis keeps
events in order, so by then every write made before the ping was forwarded. A watcher
that hears nothing for a few heartbeats has lost the feed, and must stop trusting it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import redis.exceptions

from servemesh.contract.tier_keys import model_of, watched_patterns
from servemesh_api.feature.v1 import feature_pb2

log = logging.getLogger(__name__)

# How often the hub proves the feed current (a ping round trip through Redis).
PING_S = 0.25
# A subscription whose first ping never comes back: keyspace events are off.
FIRST_PING_TIMEOUT_S = 2.0
# Watchers one replica serves at once (a gateway holds one), and the changes one may have
# waiting before it is cut off (it reconnects, its cache emptied).
MAX_WATCHERS = 64
QUEUE_LIMIT = 20_000
# Changes sent in one message at most.
BATCH_LIMIT = 1_000
# The ping key's name in the store's namespace: `~` is never the start of a view's name.
PING_NAME = "~feed:ping"


class FeedUnavailable(Exception):
    """The store does not publish keyspace events: there is no feed to give."""


class FeedOverloaded(Exception):
    """Too many watchers, or one that fell too far behind."""


# The queue item that stands for a ping come back: every earlier change was forwarded.
Heartbeat = object()


@dataclass(frozen=True)
class KeyMeaning:
    """A key's meaning: a row (view, version, entity), a view's pointer, a model's answers,
    or the hub's own ping."""

    row: tuple[str, int, str] | None = None
    view: str = ""
    model: str = ""
    ping: bool = False


def meaning_of(key: str, prefix: str) -> KeyMeaning | None:
    """What a written key means to a gateway's cache; None: nothing (load leases, sequences,
    staged rows of a view that is not yet a version number, anything not ours)."""
    if key.startswith(prefix + ":"):
        rest = key[len(prefix) + 1 :]
        if rest == PING_NAME:
            return KeyMeaning(ping=True)
        head, sep, tail = rest.partition(":")
        if not sep:
            return None
        view, at, version = head.partition("@")
        if at:
            return KeyMeaning(row=(view, int(version), tail)) if version.isdigit() else None
        return KeyMeaning(view=head) if tail == "current" else None
    model = model_of(key, prefix)
    return KeyMeaning(model=model) if model is not None else None


@dataclass
class _Watcher:
    queue: asyncio.Queue[feature_pb2.Change | object | BaseException] = field(
        default_factory=lambda: asyncio.Queue(QUEUE_LIMIT)
    )
    ready: bool = False


class ChangeHub:
    """One keyspace subscription of a feature replica, shared by its watchers; running only
    while someone watches."""

    def __init__(self, client: aioredis.Redis, prefix: str, ping_s: float = PING_S) -> None:
        self.client = client
        self.prefix = prefix
        self.ping_s = ping_s
        db = int(client.connection_pool.connection_kwargs.get("db", 0))
        self._channel_head = f"__keyspace@{db}__:"
        self._patterns = [
            f"{self._channel_head}{prefix}:*",
            *(f"{self._channel_head}{pattern}" for pattern in watched_patterns(prefix)),
        ]
        self._watchers: list[_Watcher] = []
        self._task: asyncio.Task[None] | None = None
        self._ready = False
        # The view versions rows are forwarded for (learned when a view's pointer moves);
        # a view not here has each of its row writes forwarded.
        self._current: dict[str, int] = {}

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    async def watch(self) -> AsyncGenerator[feature_pb2.Changes, None]:
        """Changes for one watcher until it hangs up; FeedUnavailable, FeedOverloaded, or a
        Redis error when the feed breaks."""
        if len(self._watchers) >= MAX_WATCHERS:
            raise FeedOverloaded(f"{MAX_WATCHERS} watchers already follow this replica's feed")
        watcher = _Watcher()
        self._watchers.append(watcher)
        if self._task is None or self._task.done():
            self._ready = False
            self._task = asyncio.get_running_loop().create_task(self._run())
        elif self._ready:
            watcher.ready = True
            watcher.queue.put_nowait(Heartbeat)
        heartbeat_ms = round(self.ping_s * 1000)
        announced = False
        try:
            while True:
                item = await watcher.queue.get()
                if isinstance(item, BaseException):
                    raise item
                message = feature_pb2.Changes(heartbeat_ms=heartbeat_ms, ready=not announced)
                announced = True
                while True:
                    if isinstance(item, feature_pb2.Change):
                        message.changes.append(item)
                    if len(message.changes) >= BATCH_LIMIT or watcher.queue.empty():
                        break
                    item = watcher.queue.get_nowait()
                    if isinstance(item, BaseException):
                        raise item
                yield message
        finally:
            if watcher in self._watchers:
                self._watchers.remove(watcher)
            if not self._watchers and self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._task
                self._task = None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    # --- the subscription -------------------------------------------------------------

    async def _run(self) -> None:
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        pinger: asyncio.Task[None] | None = None
        try:
            await pubsub.psubscribe(*self._patterns)
            pinger = asyncio.get_running_loop().create_task(self._ping())
            loop = asyncio.get_running_loop()
            first_by = loop.time() + FIRST_PING_TIMEOUT_S
            while True:
                message = await pubsub.get_message(timeout=self.ping_s)
                if message is None:
                    if not self._ready and loop.time() > first_by:
                        raise FeedUnavailable(
                            "the feature store publishes no keyspace events "
                            "(redis: notify-keyspace-events K$)"
                        )
                    continue
                await self._forward(message)
        except asyncio.CancelledError:
            raise
        except (FeedUnavailable, redis.exceptions.RedisError, OSError) as exc:
            log.warning("change feed stopped: %s", exc)
            self._end_all(exc)
        finally:
            if pinger is not None:
                pinger.cancel()
            self._ready = False
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def _ping(self) -> None:
        key = f"{self.prefix}:{PING_NAME}"
        while True:
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                # A short expiry: the key outlives no replica by long.
                await self.client.set(key, b"1", px=round(self.ping_s * 4000))
            await asyncio.sleep(self.ping_s)

    async def _forward(self, message: dict[str, object]) -> None:
        channel = message.get("channel")
        if not isinstance(channel, bytes):
            return
        key = channel.decode(errors="replace")[len(self._channel_head) :]
        meaning = meaning_of(key, self.prefix)
        if meaning is None:
            return
        change: feature_pb2.Change | object
        if meaning.ping:
            self._ready = True
            change = Heartbeat
        elif meaning.row is not None:
            view, version, entity = meaning.row
            known = self._current.get(view)
            if known is None:
                known = await self._learn_current(view)
            if known is not None and version != known:
                return  # a staged load's row, or an old version's: no reader sees it
            change = feature_pb2.Change(row=feature_pb2.RowChange(view=view, entity_id=entity))
        elif meaning.view:
            self._current.pop(meaning.view, None)
            await self._learn_current(meaning.view)
            change = feature_pb2.Change(view=meaning.view)
        else:
            change = feature_pb2.Change(model=meaning.model)
        for watcher in list(self._watchers):
            if change is Heartbeat:
                watcher.ready = True  # its stream starts at its first heartbeat
            elif not watcher.ready:
                continue
            try:
                watcher.queue.put_nowait(change)
            except asyncio.QueueFull:
                self._cut_off(watcher)

    async def _learn_current(self, view: str) -> int | None:
        """The view's current version as the store has it now (events queued behind this
        read are newer than it); None when it cannot be read: every row is forwarded."""
        try:
            raw = await self.client.get(f"{self.prefix}:{view}:current")
            self._current[view] = int(raw or 0)
        except (redis.exceptions.RedisError, ValueError):
            return None
        return self._current[view]

    def _cut_off(self, watcher: _Watcher) -> None:
        """A watcher too far behind: it gets the error next, and nothing more."""
        _end(watcher, FeedOverloaded(f"more than {QUEUE_LIMIT} changes unsent"))
        self._watchers.remove(watcher)

    def _end_all(self, exc: BaseException) -> None:
        for watcher in list(self._watchers):
            _end(watcher, exc)


def _end(watcher: _Watcher, exc: BaseException) -> None:
    """Drop what the watcher has waiting: the error is the next and last thing it reads."""
    while not watcher.queue.empty():
        watcher.queue.get_nowait()
    watcher.queue.put_nowait(exc)
