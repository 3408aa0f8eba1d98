"""The feature store's change feed as a gateway follows it, for caches that answer without
reading (a model's `cache: {freshness: feed}`; docs/tiers.md, "Freshness").

`FeedState` is the logic, no network: whether the feed is to be trusted now (a heartbeat
seen within `stale_after_s`), and whether anything an answer was made from changed while
the answer was being made (so that an answer computed from a row just overwritten is never
kept). `follow_feed` keeps one WatchChanges stream to a feature replica of the gateway's
zone (another zone's when none answers) and feeds the state.

Every break (the stream ends, errs or falls silent) starts a new epoch and empties the
caches the feed kept: changes may have been lost, so nothing cached before is trusted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

import grpc

from servemesh.identity import dial_service
from servemesh.spec import ResolvedSpec
from servemesh_api.feature.v1 import feature_pb2, feature_pb2_grpc

log = logging.getLogger(__name__)

# Heartbeats a feed may miss before it is no longer trusted (2 s at the replicas' 250 ms):
# on a busy host a heartbeat can come a second late, and each distrust empties the caches.
MISSED_HEARTBEATS = 8
# Changes remembered to judge answers under way; an answer begun before the oldest is not kept.
RECENT_CHANGES = 50_000
# Wait between tries to (re)connect.
RETRY_S = 0.5

# A remembered change: ("row", view, entity), ("view", view, ""), ("model", model, "").
ChangeKey = tuple[str, str, str]


@dataclass(frozen=True)
class FeedMark:
    """Where the feed stood when an answer was begun."""

    epoch: int
    seq: int


class FeedState:
    """What this gateway knows of the store's changes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.epoch = 0
        self.seq = 0
        self.live = False
        self.stale_after_s = 1.0
        self.heartbeat_at = -math.inf
        self._recent: deque[tuple[int, ChangeKey]] = deque(maxlen=RECENT_CHANGES)

    def fresh(self) -> bool:
        """Whether an answer may be served on the feed's word now."""
        return self.live and self.clock() - self.heartbeat_at <= self.stale_after_s

    def mark(self) -> FeedMark:
        return FeedMark(self.epoch, self.seq)

    def started(self, heartbeat_ms: int) -> None:
        """A stream's first message: changes from now on are all heard."""
        self.epoch += 1
        self._recent.clear()
        self.live = True
        self.stale_after_s = MISSED_HEARTBEATS * max(heartbeat_ms, 1) / 1000
        self.heartbeat_at = self.clock()

    def heard(self, changes: Sequence[feature_pb2.Change]) -> list[ChangeKey]:
        """A message of the stream: its changes, remembered in order, as keys."""
        self.heartbeat_at = self.clock()
        keys: list[ChangeKey] = []
        for change in changes:
            what = change.WhichOneof("what")
            if what == "row":
                key: ChangeKey = ("row", change.row.view, change.row.entity_id)
            elif what == "view":
                key = ("view", change.view, "")
            elif what == "model":
                key = ("model", change.model, "")
            else:
                continue  # a kind of change this gateway does not know: nothing it caches
            self.seq += 1
            self._recent.append((self.seq, key))
            keys.append(key)
        return keys

    def broke(self) -> None:
        """The stream is gone: nothing heard before is trusted, nothing begun is kept."""
        self.live = False
        self.epoch += 1
        self._recent.clear()

    def unchanged_since(
        self, mark: FeedMark, model: str, view: str, entity_ids: Collection[str]
    ) -> bool:
        """Whether no change the feed told of since `mark` touches an answer of `model` for
        `entity_ids` of `view` (and the feed is still the one `mark` was taken on)."""
        if not self.fresh() or mark.epoch != self.epoch:
            return False
        if mark.seq == self.seq:
            return True
        if not self._recent or self._recent[0][0] > mark.seq + 1:
            return False  # changes since the mark were forgotten: cannot tell
        for seq, (kind, name, entity) in reversed(self._recent):
            if seq <= mark.seq:
                break
            if kind == "model" and name == model:
                return False
            if kind == "view" and name == view:
                return False
            if kind == "row" and name == view and entity in entity_ids:
                return False
        return True


async def follow_feed(
    spec: Callable[[], ResolvedSpec],
    zone: str,
    caller: str,
    state: FeedState,
    wanted: Callable[[], bool],
    on_changes: Callable[[list[ChangeKey]], None],
    on_break: Callable[[], None],
    wake: asyncio.Event,
) -> None:
    """Keep a WatchChanges stream open while `wanted()` (some model's cache follows the
    feed), from this zone's feature replicas first; runs until cancelled."""
    while True:
        if not wanted():
            wake.clear()
            await wake.wait()
            continue
        current = spec()
        replicas = [i.name for i in current.instances() if i.service == "feature"]
        replicas.sort(key=lambda name: current.instance(name).zone != zone)
        for name in replicas:
            if not wanted():
                break
            try:
                await _watch(current, name, caller, state, wanted, on_changes)
            except (grpc.aio.AioRpcError, TimeoutError) as exc:
                log.info("change feed from %s ended: %s", name, _reason(exc))
            finally:
                if state.live:
                    state.broke()
                    on_break()
            await asyncio.sleep(RETRY_S)


async def _watch(
    spec: ResolvedSpec,
    replica: str,
    caller: str,
    state: FeedState,
    wanted: Callable[[], bool],
    on_changes: Callable[[list[ChangeKey]], None],
) -> None:
    async with dial_service(spec, replica, caller=caller).aio_channel() as channel:
        stub = feature_pb2_grpc.FeatureServiceStub(channel)
        call = stub.WatchChanges(feature_pb2.WatchChangesRequest())
        try:
            silence_s = 5.0  # until the first message: the replica subscribes, pings once
            while wanted():
                message = await asyncio.wait_for(_next(call), silence_s)
                if message is None:
                    return
                if message.ready:
                    state.started(message.heartbeat_ms)
                    silence_s = state.stale_after_s
                if state.live:
                    on_changes(state.heard(message.changes))
        finally:
            call.cancel()


async def _next(call: object) -> feature_pb2.Changes | None:
    reader: Callable[[], Awaitable[object]] = call.read  # type: ignore[attr-defined]
    message = await reader()
    if message is grpc.aio.EOF:
        return None
    assert isinstance(message, feature_pb2.Changes)
    return message


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return "no heartbeat in time"
