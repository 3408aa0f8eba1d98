"""The campaign: hypothesis draws one request at a time (the RPCs in turn, so every one
gets its share), sends it through Envoy or straight to a replica, and judges its answer.

A request's answer is a finding when it is no gRPC status in time (a hang), UNKNOWN, a
connection reset, INTERNAL (an unhandled exception in the service), or details that
leak a traceback or an internal class name. Around the requests, every process of the
mesh must stay alive and within a memory bound, and a trickle of valid Predicts through
the edge must all succeed.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from servemesh.contract.control_credential import control_metadata, read_control_token
from servemesh.contract.wire import (
    AUTHORIZATION_HEADER,
    MODEL_HEADER,
    OIP_SERVICE,
    VERSION_HEADER,
    message_size_options,
    method_path,
)
from servemesh.fuzz.rpcs import RPCS, Api, Rpc
from servemesh.fuzz.strategies import Known, near_valid, raw, structured
from servemesh.fuzz.watch import MemoryWatch, ValidTrickle
from servemesh.identity import Dial, dial_edge, dial_mesh, dial_service
from servemesh.launcher import Mesh
from servemesh.spec import ResolvedSpec
from servemesh.state.credentials import authorization_value, read_edge_credentials
from servemesh_api.inference import grpc_service_pb2 as oip

Via = Literal["envoy", "direct"]
Metadata = tuple[tuple[str, str], ...]

# Past its deadline, a call that has still no status is a hang.
HANG_GRACE_S = 5.0
# The default bound on any process's RSS growth over a campaign.
RSS_BOUND_BYTES = 512 * 1024 * 1024
# The client may send more than the services accept: their limits are under test.
CLIENT_MESSAGE_BYTES = 64 * 1024 * 1024
# Details that leak implementation: a traceback, a file, a repr, a Python exception name.
LEAK = re.compile(
    r"Traceback|File \"|<class '|object at 0x|\b(?:[A-Z][a-z0-9]+)+(?:Error|Exception)\b"
)
# gRPC's own answer to a body that is no protobuf of the method's type: not the service's.
UNDECODABLE = "Exception deserializing request!"
# How a request is made: near-valid (past the name checks), structured, or raw bytes.
MODES: dict[str, Callable[[Rpc, Known], st.SearchStrategy[list[bytes]]]] = {
    "near_valid": near_valid,
    "structured": structured,
    "raw": lambda rpc, known: raw(rpc),
}
RESET = re.compile(r"reset|Socket closed|Connection refused|disconnect", re.IGNORECASE)


@dataclass(frozen=True)
class Route:
    """One way to reach a service: through an Envoy listener, or straight to a replica."""

    via: Via
    name: str
    dial: Dial
    metadata: Metadata = ()


@dataclass
class Finding:
    rpc: str
    via: Via
    kind: str  # hang, unknown, reset, internal, leak
    code: str
    details: str
    count: int = 0
    sample_hex: str = ""


@dataclass
class RpcTally:
    api: Api
    control: bool
    requests: int = 0
    by_via: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    # "envoy CODE" / "direct CODE": control calls may be refused on one path and not the other.
    statuses_by_via: Counter[str] = field(default_factory=Counter)
    max_elapsed_s: float = 0.0


@dataclass
class CampaignReport:
    requests: int
    seed: int
    duration_s: float
    rpcs: dict[str, RpcTally]
    findings: list[Finding]
    dead: dict[str, int]  # process name -> the PID that is gone
    rss_growth: dict[str, int]  # process name -> peak RSS minus baseline, bytes
    rss_bound: int
    services: dict[str, str]  # process name -> its service (gateway, model, ...)
    valid_sent: int
    valid_failures: list[str]

    @property
    def ok(self) -> bool:
        return not (self.findings or self.dead or self.valid_failures or self.over_bound())

    def over_bound(self) -> dict[str, int]:
        return {n: g for n, g in self.rss_growth.items() if g > self.rss_bound}

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "seed": self.seed,
            "duration_s": round(self.duration_s, 1),
            "rpcs": {
                name: {
                    "api": t.api,
                    "control": t.control,
                    "requests": t.requests,
                    "via": dict(t.by_via),
                    "statuses": dict(t.statuses.most_common()),
                    "statuses_by_via": dict(sorted(t.statuses_by_via.items())),
                    "max_elapsed_s": round(t.max_elapsed_s, 3),
                }
                for name, t in self.rpcs.items()
            },
            "findings": [f.__dict__ for f in self.findings],
            "dead_processes": self.dead,
            "rss_growth_bytes": self.rss_growth,
            "rss_bound_bytes": self.rss_bound,
            "valid_predicts": {"sent": self.valid_sent, "failures": self.valid_failures},
            "ok": self.ok,
        }


def edge_metadata(spec: ResolvedSpec) -> Metadata:
    """The edge's basic-auth header when this mesh has edge credentials."""
    from pathlib import Path

    credentials = read_edge_credentials(Path(spec.state_dir))
    if credentials is None:
        return ()
    return ((AUTHORIZATION_HEADER, authorization_value(*credentials)),)


def routes_of(spec: ResolvedSpec) -> dict[Api, list[Route]]:
    """Every way to each API: the edge for the gateway, each zone's mesh listener for the
    others, and each replica's own port."""
    direct: dict[Api, list[Route]] = {"gateway": [], "model": [], "feature": [], "registry": []}
    for inst in spec.instances():
        direct[inst.service].append(Route("direct", inst.name, dial_service(spec, inst.name)))
    mesh = [Route("envoy", f"mesh-{z}", dial_mesh(spec, z)) for z in spec.zones]
    return {
        "gateway": [Route("envoy", "edge", dial_edge(spec), edge_metadata(spec))]
        + direct["gateway"],
        "model": mesh + direct["model"],
        "feature": mesh + direct["feature"],
        "registry": mesh + direct["registry"],
    }


def known_of(spec: ResolvedSpec) -> Known:
    """The names the mesh serves, and the served model's inputs from a replica."""
    models = {name: sorted(m.versions) for name, m in spec.models.items()}
    views = {name: list(v.features or []) for name, v in spec.feature_views.items()}
    entities = [f"user-{i}" for i in range(max(1, min(spec.demo.entities, 50)))]
    inputs: dict[str, str] = {}
    model_replica = next(i.name for i in spec.instances() if i.service == "model")
    with dial_service(spec, model_replica).channel() as channel:
        metadata = channel.unary_unary(
            method_path(OIP_SERVICE, "ModelMetadata"),
            request_serializer=oip.ModelMetadataRequest.SerializeToString,
            response_deserializer=oip.ModelMetadataResponse.FromString,
        )
        for name in models:
            reply = metadata(oip.ModelMetadataRequest(name=name), timeout=10)
            inputs.update({t.name: t.datatype for t in reply.inputs})
    return Known(models=models, views=views, entities=entities, inputs=inputs)


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    elapsed_s: float


def send(
    channel: grpc.Channel, rpc: Rpc, bodies: list[bytes], metadata: Metadata, timeout_s: float
) -> Outcome:
    """One call with the given serialized messages (identity serializers: the bytes go on
    the wire as they are)."""
    started = time.monotonic()
    try:
        if rpc.shape == "client_stream":
            channel.stream_unary(rpc.path)(iter(bodies), timeout=timeout_s, metadata=metadata)
        elif rpc.shape == "server_stream":
            body = bodies[0] if bodies else b""
            for _ in channel.unary_stream(rpc.path)(body, timeout=timeout_s, metadata=metadata):
                pass
        else:
            body = bodies[0] if bodies else b""
            channel.unary_unary(rpc.path)(body, timeout=timeout_s, metadata=metadata)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
    return Outcome(code, details, time.monotonic() - started)


def leaks(details: str, sent: bytes) -> bool:
    """Details that show implementation, not counting what the caller itself sent (a
    model named "RequestError" echoed back is no leak)."""
    if details == UNDECODABLE:
        return False
    return any(m.group().encode() not in sent for m in LEAK.finditer(details))


def judge(outcome: Outcome, timeout_s: float, sent: bytes = b"") -> str | None:
    """What is wrong with an answer, or None: hang, unknown, reset, internal, leak."""
    if outcome.elapsed_s > timeout_s + HANG_GRACE_S:
        return "hang"
    if outcome.code == grpc.StatusCode.UNKNOWN:
        return "unknown"
    if leaks(outcome.details, sent):
        return "leak"
    if outcome.code == grpc.StatusCode.UNAVAILABLE and RESET.search(outcome.details):
        return "reset"
    if outcome.code == grpc.StatusCode.INTERNAL and outcome.details != UNDECODABLE:
        return "internal"
    return None


@dataclass
class Campaign:
    """Sends and judges one drawn request at a time; `run` drives it with hypothesis."""

    spec: ResolvedSpec
    known: Known
    timeout_s: float = 5.0
    rpcs: tuple[Rpc, ...] = RPCS
    # The mesh's control credential, sent on half the control calls (None: on none).
    control_token: str | None = None
    tallies: dict[str, RpcTally] = field(default_factory=dict)
    findings: dict[tuple[str, str, str, str], Finding] = field(default_factory=dict)
    sent: int = 0
    on_progress: Callable[[int], None] | None = None
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)
    _routes: dict[Api, list[Route]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._routes = routes_of(self.spec)
        for rpc in self.rpcs:
            self.tallies[rpc.name] = RpcTally(rpc.api, rpc.control)

    def channel(self, dial: Dial) -> grpc.Channel:
        if dial.address not in self._channels:
            options = message_size_options(CLIENT_MESSAGE_BYTES)
            self._channels[dial.address] = dial.channel(options=options)
        return self._channels[dial.address]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def oip_headers(self, data: st.DataObject) -> Metadata:
        """The routing headers an OIP call through a mesh listener may carry."""
        model = data.draw(st.sampled_from(self.known.model_names))
        choices: list[Metadata] = [
            (),
            ((MODEL_HEADER, model),),
            (
                (MODEL_HEADER, model),
                (VERSION_HEADER, data.draw(st.sampled_from(self.known.versions))),
            ),
            ((MODEL_HEADER, "no-such-model"),),
        ]
        return data.draw(st.sampled_from(choices))

    def one(self, rpc: Rpc, data: st.DataObject) -> None:
        route = data.draw(st.sampled_from(self._routes[rpc.api]))
        metadata = route.metadata
        if rpc.api == "model" and route.via == "envoy":
            metadata += self.oip_headers(data)
        if rpc.control and self.control_token and data.draw(st.booleans()):
            # Half the control calls carry the mesh's credential: the other half prove the
            # refusal, these reach the input handling behind it.
            metadata += control_metadata(self.control_token)
        mode = data.draw(st.sampled_from(list(MODES)))
        bodies = data.draw(MODES[mode](rpc, self.known))
        outcome = send(self.channel(route.dial), rpc, bodies, metadata, self.timeout_s)
        self.record(rpc, route, bodies, outcome)
        self.sent += 1
        if self.on_progress is not None:
            self.on_progress(self.sent)

    def record(self, rpc: Rpc, route: Route, bodies: list[bytes], outcome: Outcome) -> None:
        tally = self.tallies[rpc.name]
        tally.requests += 1
        tally.by_via[route.via] += 1
        tally.statuses[outcome.code.name] += 1
        tally.statuses_by_via[f"{route.via} {outcome.code.name}"] += 1
        tally.max_elapsed_s = max(tally.max_elapsed_s, outcome.elapsed_s)
        kind = judge(outcome, self.timeout_s, b"".join(bodies))
        if kind is None:
            return
        key = (rpc.name, route.via, kind, outcome.details[:160])
        finding = self.findings.setdefault(
            key,
            Finding(
                rpc.name,
                route.via,
                kind,
                outcome.code.name,
                outcome.details[:500],
                sample_hex=b"".join(bodies)[:256].hex(),
            ),
        )
        finding.count += 1

    def run(self, requests: int, seed: int) -> None:
        """`requests` in all, the RPCs in turn (each an equal share, in a hypothesis run
        of its own so that its generation depends on nothing outside it)."""
        share, extra = divmod(requests, len(self.rpcs))
        for index, rpc in enumerate(self.rpcs):
            want = self.tallies[rpc.name].requests + share + (1 if index < extra else 0)
            # Hypothesis stops early once a small input space is exhausted: top up.
            for attempt in range(10):
                left = want - self.tallies[rpc.name].requests
                if left <= 0:
                    break
                _drive(partial(self.one, rpc), left, seed * 1000 + index * 10 + attempt)


def _drive(body: Callable[[st.DataObject], None], count: int, seed: int) -> None:
    """Call `body` with hypothesis's data `count` times: generation only (nothing fails,
    so nothing shrinks), no example database, reproducible from the seed."""

    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis_seed(seed)
    @given(st.data())
    def examples(data: st.DataObject) -> None:
        body(data)

    examples()


def run_campaign(
    mesh: Mesh,
    requests: int,
    seed: int = 0,
    *,
    timeout_s: float = 5.0,
    rss_bound: int = RSS_BOUND_BYTES,
    on_progress: Callable[[int], None] | None = None,
) -> CampaignReport:
    """Fuzz a running mesh with `requests` generated requests; the report says what broke."""
    spec = mesh.spec
    pids = {name: pid for name, pid in mesh.pids().items() if name != "redis"}
    services: dict[str, str] = {i.name: i.service for i in spec.instances()}
    services["envoy"] = "envoy"
    known = known_of(spec)
    campaign = Campaign(
        spec,
        known,
        timeout_s=timeout_s,
        control_token=read_control_token(spec.state_dir),
        on_progress=on_progress,
    )
    memory = MemoryWatch(pids)
    model = known.model_names[0]
    trickle = ValidTrickle(dial_edge(spec), model, known.entities, edge_metadata(spec))
    started = time.monotonic()
    memory.start()
    trickle.start()
    try:
        campaign.run(requests, seed)
    finally:
        trickle.stop()
        memory.stop()
        campaign.close()
    now = mesh.pids()
    dead = {n: p for n, p in pids.items() if now.get(n) != p or not mesh.is_running(n)}
    return CampaignReport(
        requests=campaign.sent,
        seed=seed,
        duration_s=time.monotonic() - started,
        rpcs=campaign.tallies,
        findings=sorted(campaign.findings.values(), key=lambda f: (f.rpc, f.kind)),
        dead=dead,
        rss_growth={n: memory.growth(n) for n in pids},
        rss_bound=rss_bound,
        services={n: services.get(n, n) for n in pids},
        valid_sent=trickle.sent,
        valid_failures=trickle.failures,
    )
