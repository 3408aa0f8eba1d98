"""The feature service is SERVING only while its Redis answers.

Without Redis every read fails, so a replica that still said SERVING would keep Envoy
routing to it (and the gateway waiting on it) for nothing. The probe is a PING on a
client of its own (one connection, no retries, a short timeout), so a pool busy with
reads neither delays it nor hides an outage behind redis-py's reconnect-and-retry. The
servicer pokes the watch whenever a store call fails to reach Redis, so an outage under
traffic is confirmed by PINGs at once rather than at the next interval; only PINGs
decide, several failed in a row (see `Debounce`).
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from servemesh.services.runtime import ServiceServer
from servemesh.services.runtime.dependencies import DependencyWatch, Verdict

# A healthy local Redis answers PING in well under a millisecond, and a dead one refuses the
# connection at once, so the timeout only judges a stalled Redis. It is generous because
# every feature replica shares the one Redis: a timeout short enough to trip on a busy
# machine takes all of them out together, which is an outage of its own.
PING_TIMEOUT_S = 1.0
PROBE_INTERVAL_S = 0.5
# Three failed PINGs in a row (about 1.5 s without traffic) before going down.
FAILURES_TO_FAIL = 3


def ping_client(
    url: str, timeout_s: float = PING_TIMEOUT_S, password: str | None = None
) -> aioredis.Redis:
    """A client for health PINGs only: no retries, every wait bounded by `timeout_s`."""
    return aioredis.Redis.from_url(
        url,
        password=password,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        single_connection_client=True,
    )


class RedisProbe:
    """PING the store; a Verdict naming the failure when it does not answer in time."""

    def __init__(self, client: aioredis.Redis, timeout_s: float = PING_TIMEOUT_S) -> None:
        self.client = client
        self.timeout_s = timeout_s

    async def __call__(self) -> Verdict:
        try:
            await asyncio.wait_for(self.client.ping(), self.timeout_s)
        except TimeoutError:
            return Verdict(False, f"Redis did not answer PING within {self.timeout_s} s")
        except (redis.exceptions.RedisError, OSError) as exc:
            return Verdict(False, f"Redis PING failed: {exc}"[:300])
        return Verdict(True)


class EitherAnswers:
    """A replicated store: reads go to the primary when the zone's replica is lost (and to
    the replica while no primary is elected), so the service can answer while either side
    does. The replica is asked first; the verdict names both failures."""

    def __init__(self, *probes: RedisProbe) -> None:
        self.probes = probes

    async def __call__(self) -> Verdict:
        reasons = []
        for probe in self.probes:
            verdict = await probe()
            if verdict.ok:
                return verdict
            reasons.append(verdict.reason)
        return Verdict(False, "; ".join(reasons))


def watch_store(
    server: ServiceServer,
    url: str,
    password: str | None = None,
    *,
    primary: aioredis.Redis | None = None,
) -> DependencyWatch:
    """The feature service's health follows its Redis (started; stopped with the server):
    the one it reads at `url`, or, when that is a replica, the `primary` as well."""
    client = ping_client(url, password=password)
    read = RedisProbe(client)
    probe = read if primary is None else EitherAnswers(read, RedisProbe(primary))
    watch = DependencyWatch(
        server,
        probe,
        what="feature store (Redis)",
        interval_s=PROBE_INTERVAL_S,
        failures_to_fail=FAILURES_TO_FAIL,
    )
    server.on_stop(client.aclose)
    watch.start()
    return watch
