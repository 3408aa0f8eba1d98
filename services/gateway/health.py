"""The gateway is SERVING only while it can answer a prediction.

It cannot answer when
- its zone's Envoy mesh listener does not accept connections (its only path downstream);
- no feature service replica anywhere is SERVING while some model that reads features has
  no `fallback_score`;
- no model replica anywhere is SERVING while some model has no `fallback_score`.
A model with a fallback is still answered (degraded) without its dependencies, so it
never takes the gateway down: the "feature store down" drill depends on those answers.

How the gateway learns its dependencies' health:
- **Replicas: their own gRPC health service, watched directly** at the addresses the spec
  names: one `Health.Watch` stream per replica, which the replica answers at once and
  again on every change of its status. That is the signal Envoy's active health checks
  act on, so the gateway agrees with Envoy about who may serve. A replica that dies ends
  its stream at once; one that stalls with its connection open stops answering the
  stream's keepalive pings (one a second, HEALTH_WATCH_PING_TIMEOUT_MS to answer) and the
  connection is dropped.
  Either way the replica counts as not SERVING from then until a new stream says it is,
  and the watch probes at once. Polling Check every half second instead cost every
  replica and every gateway calls all day long, idle or not: most of the mesh's idle CPU.
  A health call through the mesh listener would reach at most the one replica Envoy
  picks (and the listener has no route for it), not say whether any is SERVING; asking
  Envoy's admin API instead would tie the gateway to one Envoy's admin port and its
  cluster names, for the same answer.
- **The mesh listener: a TCP connect**, not the mesh channel's state. The channel is
  lazy (IDLE says nothing about Envoy until a call is made) and, after a failure, waits
  out gRPC's reconnect backoff (up to two minutes) before it tries again; a connect
  answers exactly "does the listener accept connections", at once.
Which replicas exist and which models need what follow the running spec
(`GatewayHealth.follow_spec`): a model or a fallback added live changes the rule at the
next round. The rule itself (`needs_of`, `judge`) is pure and tested without a network.

Limits: with zones in network namespaces a gateway reaches only its own zone's replicas
directly, so it counts the other zones' replicas as not SERVING (it goes down only when
its own zone has none, though Envoy could still fail over to the others).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.contract.wire import health_watch_options, reconnect_backoff_options
from servemesh.identity import OPERATOR_IDENTITY, dial_service
from servemesh.services.runtime import ServiceServer
from servemesh.services.runtime.dependencies import DependencyWatch, Verdict
from servemesh.services.runtime.tracing import client_interceptors
from servemesh.spec import MeshSpec, ModelSpec, ResolvedSpec, proxy_part

PROBE_INTERVAL_S = 0.5
# Each replica's Check and the listener's connect: far above a healthy local answer (a dead
# peer refuses at once; the timeout only judges a stalled one), and above what a busy
# machine adds, since every gateway would time out together.
PROBE_TIMEOUT_S = 1.0
# Two rounds in a row (about 1 s): the replicas' own health is already debounced, and a
# dead listener refuses at once; one slow round still does not take a gateway out.
FAILURES_TO_FAIL = 2


def reads_features(model: ModelSpec) -> bool:
    """Whether a prediction of `model` looks up a feature view (a model whose inputs are all
    raw, sent by the caller, does not)."""
    return bool(model.views)


@dataclass(frozen=True)
class Needs:
    """What the gateway cannot answer without: the models that need each dependency."""

    features: tuple[str, ...]  # read features and have no fallback_score
    models: tuple[str, ...]  # have no fallback_score


def needs_of(spec: MeshSpec) -> Needs:
    unprotected = sorted(name for name, m in spec.models.items() if m.fallback_score is None)
    return Needs(
        features=tuple(name for name in unprotected if reads_features(spec.models[name])),
        models=tuple(unprotected),
    )


@dataclass(frozen=True)
class Seen:
    """One round of probes: the listener, and the replicas that answered SERVING."""

    mesh_listener: bool
    feature_serving: int
    feature_total: int
    model_serving: int
    model_total: int


def _listed(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def judge(needs: Needs, seen: Seen, mesh_address: str = "") -> Verdict:
    """Can the gateway answer? The rule of the module docstring, with the first reason."""
    if not seen.mesh_listener:
        return Verdict(False, f"the zone's mesh listener {mesh_address} refuses connections")
    if needs.features and seen.feature_serving == 0:
        return Verdict(
            False,
            f"no feature service replica is SERVING (of {seen.feature_total}), and "
            f"{_listed(needs.features)} read features without a fallback_score",
        )
    if needs.models and seen.model_serving == 0:
        return Verdict(
            False,
            f"no model replica is SERVING (of {seen.model_total}), and "
            f"{_listed(needs.models)} have no fallback_score",
        )
    return Verdict(True)


async def accepts_connections(host: str, port: int, timeout_s: float) -> bool:
    """A TCP connect to host:port succeeds within `timeout_s` (closed again at once)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


class GatewayHealth:
    """The gateway's probe: one round checks the listener and counts the replicas that the
    replicas' health watches (one stream each) say are SERVING."""

    def __init__(
        self,
        spec: ResolvedSpec,
        zone: str,
        timeout_s: float = PROBE_TIMEOUT_S,
        *,
        caller: str = OPERATOR_IDENTITY,
    ) -> None:
        self.spec = spec
        self.zone = zone
        self.timeout_s = timeout_s
        # The identity the watches present (the gateway's own certificate).
        self.caller = caller
        # Called when a replica's status changes (the dependency watch probes at once).
        self.on_change: Callable[[], None] = lambda: None
        # One channel and one watch per replica, keyed by (instance, address): a moved
        # replica gets new ones.
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}
        self._watches: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._serving: dict[tuple[str, str], bool] = {}

    async def follow_spec(self, spec: ResolvedSpec) -> None:
        """Judge by `spec` from the next round on (models, fallbacks, replicas)."""
        self.spec = spec
        wanted = self._wanted(spec)
        for key in set(self._watches) - wanted:
            self._watches.pop(key).cancel()
            self._serving.pop(key, None)
        for key in set(self._channels) - wanted:
            await self._channels.pop(key).close()

    @staticmethod
    def _wanted(spec: ResolvedSpec) -> set[tuple[str, str]]:
        return {
            (i.name, spec.address_of(i.name))
            for i in spec.instances()
            if i.service in ("feature", "model")
        }

    def _channel(self, key: tuple[str, str]) -> grpc.aio.Channel:
        channel = self._channels.get(key)
        if channel is None:
            # Retry a lost replica often, or its return is noticed only after gRPC's backoff.
            channel = dial_service(self.spec, key[0], caller=self.caller).aio_channel(
                options=[
                    *reconnect_backoff_options(int(PROBE_INTERVAL_S * 1000)),
                    *health_watch_options(),
                ],
                interceptors=client_interceptors(),
            )
            self._channels[key] = channel
        return channel

    def _watching(self, spec: ResolvedSpec) -> None:
        """A watch for every replica of the spec that has none yet."""
        loop = asyncio.get_running_loop()
        for key in self._wanted(spec):
            if key not in self._watches:
                self._watches[key] = loop.create_task(self._watch(key), name=f"health-{key[0]}")

    def _set(self, key: tuple[str, str], serving: bool) -> None:
        if self._serving.get(key) != serving:
            self._serving[key] = serving
            self.on_change()

    async def _watch(self, key: tuple[str, str]) -> None:
        """Follow one replica's status until cancelled; not SERVING whenever its stream is
        down, and a new stream a moment later."""
        stub = health_pb2_grpc.HealthStub(self._channel(key))
        while True:
            call = stub.Watch(health_pb2.HealthCheckRequest())
            try:
                async for reply in call:
                    self._set(key, reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError:
                pass
            finally:
                call.cancel()
            self._set(key, False)
            await asyncio.sleep(PROBE_INTERVAL_S)

    def _count(self, spec: ResolvedSpec, service: str) -> tuple[int, int]:
        """(SERVING, all) replicas of `service`, as their watches say now."""
        keys = [(i.name, spec.address_of(i.name)) for i in spec.instances() if i.service == service]
        return sum(self._serving.get(key, False) for key in keys), len(keys)

    async def __call__(self) -> Verdict:
        spec = self.spec
        self._watching(spec)
        needs = needs_of(spec)
        mesh = spec.mesh_address_for(self.zone)
        # The zone's own Envoy's host (proxy.layout per_zone: not the edge's).
        listener = await accepts_connections(
            spec.host_of(proxy_part(spec.proxy_of_zone(self.zone))),
            spec.mesh_ports[self.zone],
            self.timeout_s,
        )
        features = self._count(spec, "feature")
        models = self._count(spec, "model")
        seen = Seen(listener, features[0], features[1], models[0], models[1])
        return judge(needs, seen, mesh)

    async def redial(self) -> None:
        """Drop every watch and its channel; the next round dials with the current
        certificate."""
        await self.close()

    async def close(self) -> None:
        for task in self._watches.values():
            task.cancel()
        self._watches.clear()
        self._serving.clear()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def watch_dependencies(server: ServiceServer, spec: ResolvedSpec, instance: str) -> GatewayHealth:
    """SERVING only while the gateway can answer; follows the running spec; stops with
    the server."""
    health = GatewayHealth(spec, spec.instance(instance).zone, caller=instance)
    watch = DependencyWatch(
        server,
        health,
        what="gateway's path downstream",
        interval_s=PROBE_INTERVAL_S,
        failures_to_fail=FAILURES_TO_FAIL,
    )
    health.on_change = watch.poke
    server.on_spec_change(health.follow_spec)
    server.on_stop(health.close)
    watch.start()
    return health
