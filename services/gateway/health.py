"""The gateway is SERVING only while it can answer a prediction.

It cannot answer when
- its zone's Envoy mesh listener does not accept connections (its only path downstream);
- no feature service replica anywhere is SERVING while some model that reads features has
  no `fallback_score`;
- no model replica anywhere is SERVING while some model has no `fallback_score`.
A model with a fallback is still answered (degraded) without its dependencies, so it
never takes the gateway down: the "feature store down" drill depends on those answers.

How the gateway learns its dependencies' health:
- **Replicas: their own gRPC health service, probed directly** at the addresses the spec
  names, every `PROBE_INTERVAL_S`. That is the signal Envoy's active health checks act
  on, so the gateway agrees with Envoy about who may serve. A health call through the
  mesh listener would reach at most the one replica Envoy picks (and the listener has no
  route for it), not say whether any is SERVING; asking Envoy's admin API instead would
  tie the gateway to one Envoy's admin port and its cluster names, for the same answer.
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
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from servemesh.identity import OPERATOR_IDENTITY, dial_service
from servemesh.services.runtime import ServiceServer
from servemesh.services.runtime.dependencies import DependencyWatch, Verdict
from servemesh.services.runtime.tracing import client_interceptors
from servemesh.spec import ENVOY_PART, MeshSpec, ModelSpec, ResolvedSpec
from servemesh.wire import reconnect_backoff_options

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
    """The gateway's probe: one round checks the listener and every replica it needs."""

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
        # The identity the probes present (the gateway's own certificate).
        self.caller = caller
        # One channel per replica, keyed by (instance, address): a moved replica gets a new one.
        self._channels: dict[tuple[str, str], grpc.aio.Channel] = {}

    async def follow_spec(self, spec: ResolvedSpec) -> None:
        """Judge by `spec` from the next round on (models, fallbacks, replicas)."""
        self.spec = spec
        wanted = {(i.name, spec.address_of(i.name)) for i in spec.instances()}
        for key in set(self._channels) - wanted:
            await self._channels.pop(key).close()

    def _channel(self, instance: str) -> grpc.aio.Channel:
        key = (instance, self.spec.address_of(instance))
        channel = self._channels.get(key)
        if channel is None:
            # Retry a lost replica often, or its return is noticed only after gRPC's backoff.
            channel = dial_service(self.spec, instance, caller=self.caller).aio_channel(
                options=reconnect_backoff_options(int(PROBE_INTERVAL_S * 1000)),
                interceptors=client_interceptors(),
            )
            self._channels[key] = channel
        return channel

    async def _serving(self, instance: str) -> bool:
        stub = health_pb2_grpc.HealthStub(self._channel(instance))
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def _count(self, spec: ResolvedSpec, service: str, wanted: bool) -> tuple[int, int]:
        """(SERVING, all) replicas of `service`; not probed when no model needs them."""
        names = [i.name for i in spec.instances() if i.service == service]
        if not wanted:
            return 0, len(names)
        answers = await asyncio.gather(*(self._serving(name) for name in names))
        return sum(answers), len(names)

    async def __call__(self) -> Verdict:
        spec = self.spec
        needs = needs_of(spec)
        mesh = spec.mesh_address_for(self.zone)
        listener, features, models = await asyncio.gather(
            accepts_connections(
                spec.host_of(ENVOY_PART), spec.mesh_ports[self.zone], self.timeout_s
            ),
            self._count(spec, "feature", bool(needs.features)),
            self._count(spec, "model", bool(needs.models)),
        )
        seen = Seen(listener, features[0], features[1], models[0], models[1])
        return judge(needs, seen, mesh)

    async def redial(self) -> None:
        """Drop every probe channel; the next round dials with the current certificate."""
        await self.close()

    async def close(self) -> None:
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
    server.on_spec_change(health.follow_spec)
    server.on_stop(health.close)
    watch.start()
    return health
