"""Envoy is not a remote control, and its edge trusts nothing a caller says: each rule
observed on a real Envoy.

Two kinds of fixture. `front` is a real Envoy, rendered from a spec exactly as `servemesh up`
renders it, in front of one recording gRPC server that stands in for every service: it
answers any method and remembers what reached it (path and metadata), so a test can see
what Envoy let through. `mesh` (tests/mesh/conftest.py) is the whole mesh, for the issue's
own scenario: unloading a model through Envoy's listeners.
"""

from __future__ import annotations

import os
import socket
import ssl
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2

from servemesh.contract.wire import (
    AUTHORIZATION_HEADER,
    BUCKET_HEADER,
    CALLER_HEADER,
    CALLER_ROLE_HEADER,
    CONTROL_METHODS,
    GATEWAY_SERVICE,
    HEALTH_SERVICE,
    MODEL_HEADER,
    OIP_SERVICE,
    REGISTRY_SERVICE,
    REQUEST_ID_HEADER,
    SHADOW_ROLE_HEADER,
    SHADOW_ROLE_PRIMARY,
    SHADOW_ROLE_SHADOW,
    VERSION_HEADER,
    fault_runtime_prefix,
    method_path,
)
from servemesh.identity import (
    EDGE_IDENTITY,
    ENVOY_IDENTITY,
    OPERATOR_IDENTITY,
    Dial,
    dial_edge,
    dial_mesh,
    dial_service,
    issue_mesh_certificates,
    mesh_identity,
    serving_credentials,
)
from servemesh.launcher import Mesh, envoy_child
from servemesh.procs import All, Check, Supervisor, TcpPort
from servemesh.proxy.admin import (
    AdminClient,
    AdminError,
    admin_dir,
    admin_socket_path,
    prepare_admin_dir,
)
from servemesh.proxy.process import envoy_command, validate_config
from servemesh.proxy.render import render_resources, static_bootstrap
from servemesh.spec import MeshSpec, Ports, ProxySpec, ResolvedSpec, is_edge_proxy, resolve
from servemesh.spec.policy import (
    EdgeAuth,
    Overload,
    RateLimit,
    RetryPolicy,
    RoutePolicy,
    ShadowSpec,
    TrafficSpec,
)
from servemesh.state.credentials import authorization_value, htpasswd_line
from servemesh_api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from servemesh_api.inference import grpc_service_pb2 as oip
from servemesh_api.inference import grpc_service_pb2_grpc as oip_grpc
from tests.waiting import wait_until

USER, KEY = "edge", "a-test-key-that-is-only-for-this-test"
PREDICT = method_path(GATEWAY_SERVICE, "Predict")
MODEL_INFER = method_path(OIP_SERVICE, "ModelInfer")
HEALTH_CHECK = method_path(HEALTH_SERVICE, "Check")
HEALTH_WATCH = method_path(HEALTH_SERVICE, "Watch")
# Metadata the recording server obeys: hold the answer this many ms.
HOLD = "test-hold-ms"
# Hold only the first try of a request (by its x-request-id, which Envoy keeps on every try):
# the one gateway a call reached first is slow, any other answers at once.
HOLD_FIRST_TRY = "test-hold-first-try-ms"


# --- a recording stand-in for every service ----------------------------------------------


@dataclass
class Seen:
    method: str
    metadata: dict[str, str]


@dataclass
class Recorder(grpc.GenericRpcHandler):
    """Answers every method (health: SERVING) and records each call but health checks."""

    calls: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    tried: set[str] = field(default_factory=set)

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = str(handler_call_details.method)
        if method == HEALTH_CHECK:
            serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
            return grpc.unary_unary_rpc_method_handler(lambda *_: serving.SerializeToString())
        metadata = {str(k): str(v) for k, v in handler_call_details.invocation_metadata or ()}
        with self.lock:
            self.calls.append(Seen(method, metadata))
        if method == HEALTH_WATCH:
            return grpc.unary_stream_rpc_method_handler(self._watch)
        return grpc.unary_unary_rpc_method_handler(self._answer)

    def _answer(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        metadata = dict(context.invocation_metadata())
        hold_ms = metadata.get(HOLD)
        if HOLD_FIRST_TRY in metadata:
            request_id = str(metadata.get(REQUEST_ID_HEADER))
            with self.lock:
                first = request_id not in self.tried
                self.tried.add(request_id)
            hold_ms = metadata[HOLD_FIRST_TRY] if first else None
        if hold_ms:
            done = threading.Event()
            context.add_callback(done.set)  # Envoy gave up: stop holding
            done.wait(int(str(hold_ms)) / 1000)
        return b""

    @staticmethod
    def _watch(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield health_pb2.HealthCheckResponse(
            status=health_pb2.HealthCheckResponse.SERVING
        ).SerializeToString()

    def seen(self, method: str | None = None) -> list[Seen]:
        with self.lock:
            return [c for c in self.calls if method is None or c.method == method]

    def paths(self) -> set[str]:
        with self.lock:
            return {c.method for c in self.calls}


@dataclass
class Front:
    """A real Envoy rendered from `spec`, every upstream a `Recorder`."""

    spec: ResolvedSpec
    recorder: Recorder
    admin: AdminClient

    @property
    def edge(self) -> Dial:
        return dial_edge(self.spec)

    def mesh(self, zone: str) -> Dial:
        return dial_mesh(self.spec, zone)


FrontFactory = Callable[[TrafficSpec], Front]


def _front_spec(state_dir: Path, traffic: TrafficSpec) -> ResolvedSpec:
    # The default model, with every call mirrored to v2: Envoy marks the primary call and
    # the copy itself, whatever role a caller claims. One Envoy holds every listener (the
    # shared layout): each listener is rendered the same when the per-zone layout splits
    # them over the edge's Envoy and each zone's (tests/unit/test_zone_proxies_render.py).
    fraud = MeshSpec().models["fraud"].model_copy(update={"shadow": ShadowSpec(version="v2")})
    return resolve(
        MeshSpec(
            ports=Ports.free(),
            state_dir=str(state_dir),
            traffic=traffic,
            models={"fraud": fraud},
            proxy=ProxySpec(layout="shared"),
        )
    )


@pytest.fixture(scope="module")
def front_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontFactory]:
    stack: list[tuple[Supervisor, grpc.Server]] = []

    def start(traffic: TrafficSpec) -> Front:
        state = tmp_path_factory.mktemp("front")
        spec = _front_spec(state, traffic)
        recorder = Recorder()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        server.add_generic_rpc_handlers((recorder,))
        # Envoy dials every replica with mutual TLS and checks its name: each port shows
        # the certificate of the instance it stands in for.
        issue_mesh_certificates(spec)
        for instance in spec.instances():
            server.add_secure_port(
                spec.address_of(instance.name), serving_credentials(spec, instance.name)
            )
        server.start()
        config = state / "envoy.yaml"
        resources = render_resources(spec, state)
        config.write_text(yaml.safe_dump(static_bootstrap(spec, resources, state)))
        validate_config(config)
        supervisor = Supervisor(state / "logs", cwd=state, grace_s=5.0, thread_name="front")
        stack.append((supervisor, server))
        socket_path = prepare_admin_dir(state)
        admin = AdminClient(socket_path)
        ready = All(Check(admin.is_ready, "Envoy admin ready"), TcpPort(spec.host, spec.ports.edge))
        supervisor.start(
            "envoy",
            envoy_command(config, base_id=spec.ports.envoy_admin),
            ready=ready,
            timeout_s=60,
        )
        return Front(spec=spec, recorder=recorder, admin=admin)

    yield start
    for supervisor, server in stack:
        supervisor.close()
        server.stop(grace=None)


@pytest.fixture(scope="module")
def front(front_factory: FrontFactory) -> Front:
    """Edge auth on, the drill profile on, a caller's deadline capped at 1.5 s."""
    edge = RoutePolicy(
        retries=RetryPolicy(retry_on=["connect-failure", "refused-stream"], per_try_timeout_ms=0),
        grpc_timeout_header_max_ms=1500,
    )
    traffic = TrafficSpec(
        edge=edge,
        edge_auth=EdgeAuth(enabled=True, users=[htpasswd_line(USER, KEY)]),
        runtime_overrides=True,
    )
    started = front_factory(traffic)
    _wait_every_upstream_healthy(started)
    return started


def _wait_every_upstream_healthy(front: Front) -> None:
    def all_healthy() -> bool:
        views = front.admin.clusters()
        return bool(views) and all(h.healthy for v in views.values() for h in v.hosts)

    wait_until(all_healthy, "every cluster of the front's Envoy healthy")


AUTH = ((AUTHORIZATION_HEADER, authorization_value(USER, KEY)),)


def _call(
    dial: Dial,
    path: str,
    metadata: tuple[tuple[str, str], ...] = (),
    timeout_s: float = 10.0,
) -> grpc.StatusCode:
    """Send an empty message to `path`; the status that came back."""
    with dial.channel() as channel:
        method = channel.unary_unary(path)
        try:
            method(b"", metadata=metadata, timeout=timeout_s)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


# --- control calls -----------------------------------------------------------------------


def test_control_calls_are_refused_on_the_edge_and_every_mesh_listener(front: Front) -> None:
    listeners = {"edge": front.edge} | {z: front.mesh(z) for z in front.spec.zones}
    for name, address in listeners.items():
        metadata = AUTH if name == "edge" else ()
        for path in sorted(CONTROL_METHODS):
            assert _call(address, path, metadata) == grpc.StatusCode.PERMISSION_DENIED, (
                name,
                path,
            )
    assert not front.recorder.paths() & CONTROL_METHODS


def test_other_spellings_of_a_control_path_never_reach_a_service_as_one(front: Front) -> None:
    unload = method_path(OIP_SERVICE, "RepositoryModelUnload")
    service, _, method = unload[1:].partition("/")
    spellings = [
        f"//{service}/{method}",
        f"/{service}//{method}",
        f"/{service}/./{method}",
        f"/x/../{service}/{method}",
        f"/{service}%2F{method}",
        f"/{service}/%52{method[1:]}",
    ]
    for spelling in spellings:
        code = _call(front.mesh(front.spec.zones[0]), spelling)
        assert code != grpc.StatusCode.OK or spelling not in front.recorder.paths(), spelling
    # Whatever reached the stand-in, none of it was the control method's own path (a gRPC
    # server dispatches on the exact path, so any other spelling is UNIMPLEMENTED there).
    assert unload not in front.recorder.paths()


def test_artifact_downloads_and_data_calls_still_pass_the_mesh_listeners(front: Front) -> None:
    download = method_path(REGISTRY_SERVICE, "DownloadArtifact")
    for zone in front.spec.zones:
        assert _call(front.mesh(zone), download) == grpc.StatusCode.OK
        assert _call(front.mesh(zone), MODEL_INFER, ((MODEL_HEADER, "fraud"),)) == (
            grpc.StatusCode.OK
        )
    assert len(front.recorder.seen(download)) >= len(front.spec.zones)


def test_unloading_a_model_through_envoy_is_refused_and_changes_nothing(mesh: Mesh) -> None:
    """The issue's scenario: RepositoryModelUnload sent to each zone's mesh listener (and
    to the edge) unloaded `fraud` on the replicas. Now every one is PERMISSION_DENIED and
    each replica still holds and serves the model."""
    request = oip.RepositoryModelUnloadRequest(model_name="fraud")
    dials = [dial_edge(mesh.spec)] + [dial_mesh(mesh.spec, z) for z in mesh.spec.zones]
    for dial in dials:
        for _ in range(2):
            with dial.channel() as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    oip_grpc.GRPCInferenceServiceStub(channel).RepositoryModelUnload(
                        request, timeout=10
                    )
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, dial.address
    replicas = [i.name for i in mesh.spec.instances() if i.service == "model"]
    for name in replicas:
        with dial_service(mesh.spec, name).channel() as channel:
            ready = oip_grpc.GRPCInferenceServiceStub(channel).ModelReady(
                oip.ModelReadyRequest(name="fraud", version="v1"), timeout=10
            )
        assert ready.ready, name
    with dial_edge(mesh.spec).channel() as channel:
        answer = gateway_pb2_grpc.GatewayStub(channel).Predict(
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-1"]), timeout=10
        )
    assert len(answer.scores) == 1


# --- admin and runtime -------------------------------------------------------------------


def _listening_ports(pid: int) -> set[int]:
    """TCP ports on which process `pid` holds a listening socket."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_admin_is_a_socket_in_a_private_directory_and_no_tcp_port(mesh: Mesh) -> None:
    folder = admin_dir(mesh.state_dir)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    spec = mesh.spec
    for proxy in spec.proxies():
        admin = AdminClient(admin_socket_path(mesh.state_dir, proxy))
        assert stat.S_ISSOCK(admin.socket_path.stat().st_mode)
        assert admin.is_ready()
        assert admin.socket_path.parent == folder
        listening = _listening_ports(mesh.pid(envoy_child(proxy)))
        # Its listeners (the edge's, or a zone's mesh listener) and its stats listener
        # (GET /stats/prometheus only); never an admin port.
        zones = [z for z in spec.zones if spec.proxy_of_zone(z) == proxy]
        own = {spec.mesh_ports[z] for z in zones} | {spec.proxy_stats_port(proxy)}
        served = own | ({spec.edge_port_of(proxy)} if is_edge_proxy(proxy) else set())
        assert listening == served, proxy
        assert spec.ports.envoy_admin not in listening


def test_a_runtime_override_is_refused_without_the_drill_profile(mesh: Mesh) -> None:
    admin = AdminClient.of_mesh(mesh.state_dir)
    key = f"{fault_runtime_prefix('model.fraud')}.abort_percent"
    with pytest.raises(AdminError):
        admin.set_runtime({key: 100})
    assert key not in admin.runtime()
    with dial_edge(mesh.spec).channel() as channel:
        answer = gateway_pb2_grpc.GatewayStub(channel).Predict(
            gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-2"]), timeout=10
        )
    assert len(answer.scores) == 1


def test_a_runtime_override_works_in_the_drill_profile(front: Front) -> None:
    key = f"{fault_runtime_prefix('edge')}.abort_percent"
    front.admin.set_runtime({key: 100})
    try:
        assert _call(front.edge, PREDICT, AUTH) == grpc.StatusCode.UNAVAILABLE
    finally:
        front.admin.set_runtime({key: 0})
    assert _call(front.edge, PREDICT, AUTH) == grpc.StatusCode.OK


# --- the hardened edge -------------------------------------------------------------------


def _stat_names(admin: AdminClient) -> set[str]:
    return {line.partition(":")[0] for line in admin.get("/stats").splitlines()}


def test_random_method_paths_do_not_grow_envoy_s_stats(front: Front) -> None:
    # Known methods first, so their stats exist before counting.
    assert _call(front.edge, PREDICT, AUTH) == grpc.StatusCode.OK
    zone = front.spec.zones[0]
    assert _call(front.mesh(zone), MODEL_INFER) == grpc.StatusCode.OK
    before = _stat_names(front.admin)
    names = []
    with (
        front.edge.channel() as edge,
        front.mesh(zone).channel() as inside,
    ):
        for i in range(500):
            name = uuid.uuid4().hex
            names.append(name)
            edge.unary_unary(f"/pkg{i}.S{name}/M{name}")(b"", metadata=AUTH, timeout=10)
            inside.unary_unary(f"/{OIP_SERVICE}/M{name}")(b"", timeout=10)
    after = _stat_names(front.admin)
    assert len(front.recorder.seen()) >= 1000
    grown = after - before
    # No stat is named after a path a caller chose; what does appear is a fixed set (the
    # unknown-method bucket of each cluster's gRPC stats, and the like), not one per path.
    assert not [stat for stat in grown if any(name in stat for name in names)]
    assert len(grown) < 100, sorted(grown)[:20]


def test_callers_x_envoy_headers_are_not_obeyed(front: Front) -> None:
    # Obeyed, this header would cut the call after 1 ms; the stand-in holds it 300 ms.
    metadata = (*AUTH, ("x-envoy-upstream-rq-timeout-ms", "1"), (HOLD, "300"))
    assert _call(front.edge, PREDICT, metadata) == grpc.StatusCode.OK
    assert _call(front.mesh(front.spec.zones[0]), MODEL_INFER, metadata[1:]) == (grpc.StatusCode.OK)


def test_the_edge_makes_its_own_request_id_and_the_mesh_keeps_the_gateway_s(
    front: Front,
) -> None:
    mine = "caller-chosen-id"
    assert _call(front.edge, PREDICT, (*AUTH, (REQUEST_ID_HEADER, mine))) == grpc.StatusCode.OK
    seen = front.recorder.seen(PREDICT)[-1].metadata[REQUEST_ID_HEADER]
    assert seen != mine and uuid.UUID(seen)
    gateways_id = str(uuid.uuid4())
    zone = front.spec.zones[0]
    assert _call(front.mesh(zone), MODEL_INFER, ((REQUEST_ID_HEADER, gateways_id),)) == (
        grpc.StatusCode.OK
    )
    assert front.recorder.seen(MODEL_INFER)[-1].metadata[REQUEST_ID_HEADER] == gateways_id


def test_a_caller_s_deadline_is_capped_at_the_edge(front: Front) -> None:
    started = time.monotonic()
    code = _call(front.edge, PREDICT, (*AUTH, (HOLD, "30000")), timeout_s=60)
    elapsed = time.monotonic() - started
    # The cap is 1.5 s; the caller asked for 60 s and the stand-in holds 30 s.
    assert code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    assert elapsed < 20, elapsed


def test_only_health_check_is_open_at_the_edge(front: Front) -> None:
    with front.edge.channel() as channel:
        check = channel.unary_unary(HEALTH_CHECK)
        answer = health_pb2.HealthCheckResponse.FromString(
            check(health_pb2.HealthCheckRequest().SerializeToString(), timeout=10)
        )
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        watch = channel.unary_stream(HEALTH_WATCH)
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(watch(b"", timeout=10)))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # With credentials, Watch is an ordinary call.
        assert next(iter(watch(b"", metadata=AUTH, timeout=10)))
    assert len(front.recorder.seen(HEALTH_WATCH)) == 1


def test_internal_headers_from_callers_never_reach_a_service(front: Front) -> None:
    forged = (
        (MODEL_HEADER, "fraud"),
        (VERSION_HEADER, "v2"),
        (SHADOW_ROLE_HEADER, "shadow"),
        (BUCKET_HEADER, "9999"),  # a caller choosing its bucket would choose its version
        # Who the caller is, as the edge's auth found it: Envoy's to say, never the caller's.
        (CALLER_ROLE_HEADER, "operator"),
        (CALLER_HEADER, "someone-else"),
    )
    assert _call(front.edge, PREDICT, (*AUTH, *forged)) == grpc.StatusCode.OK
    reached = front.recorder.seen(PREDICT)[-1].metadata
    internal = {k: v for k, v in reached.items() if k.startswith("x-servemesh-")}
    assert internal == {CALLER_HEADER: USER}, reached  # the user basic auth verified
    # Inside, the model header is the gateway's to send; the shadow role is Envoy's alone:
    # the served call says "primary" (v1, the split's choice) and only the mirrored copy
    # (v2) says "shadow", whatever the caller claimed.
    for zone in front.spec.zones:
        before = len(front.recorder.seen(MODEL_INFER))
        inside = ((MODEL_HEADER, "fraud"), (SHADOW_ROLE_HEADER, SHADOW_ROLE_SHADOW))
        assert _call(front.mesh(zone), MODEL_INFER, inside) == grpc.StatusCode.OK

        def both(before: int = before) -> list[Seen] | None:
            calls = front.recorder.seen(MODEL_INFER)[before:]
            return calls if len(calls) >= 2 else None

        roles = {
            c.metadata[VERSION_HEADER]: c.metadata.get(SHADOW_ROLE_HEADER)
            for c in wait_until(both, "the primary call and its mirrored copy")
        }
        assert roles == {"v1": SHADOW_ROLE_PRIMARY, "v2": SHADOW_ROLE_SHADOW}, roles


def _http1_answer(spec: ResolvedSpec, port: int, server: str) -> bytes:
    """What a TLS client offering only HTTP/1.1 (with the operator's certificate) hears."""
    identity = mesh_identity(spec)
    context = ssl.create_default_context(cafile=str(identity.trust_file))
    context.set_alpn_protocols(["http/1.1"])
    operator = identity.leaf(OPERATOR_IDENTITY)
    context.load_cert_chain(operator.cert, operator.key)
    with socket.create_connection((spec.host, port), timeout=10) as raw:
        try:
            sock = context.wrap_socket(raw, server_hostname=f"{server}.{spec.name}.internal")
        except ssl.SSLError as exc:  # no protocol in common: the handshake itself fails
            return f"TLS refused: {exc.reason}".encode()
        with sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
            return b"".join(chunks)


def test_mesh_listeners_speak_http2_only(front: Front) -> None:
    for zone in front.spec.zones:
        answer = _http1_answer(front.spec, front.spec.mesh_ports[zone], ENVOY_IDENTITY)
        assert not answer.startswith(b"HTTP/1"), answer[:80]
    # The edge still answers HTTP/1.1 (with 401: no credentials).
    answer = _http1_answer(front.spec, front.spec.ports.edge, EDGE_IDENTITY)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:80]


def test_the_edge_sheds_a_flood_of_bad_credentials_before_checking_them(
    front_factory: FrontFactory,
) -> None:
    traffic = TrafficSpec(
        edge_auth=EdgeAuth(enabled=True, users=[htpasswd_line(USER, KEY)]),
        rate_limit=RateLimit(requests_per_second=1, burst=3),
    )
    tight = front_factory(traffic)
    bad = ((AUTHORIZATION_HEADER, authorization_value(USER, "wrong")),)
    codes = [_call(tight.edge, PREDICT, bad) for _ in range(30)]
    # Rate limited first: most are shed (RESOURCE_EXHAUSTED) without their credentials
    # ever being checked; the few within the bucket are checked and refused.
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 20, codes
    assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED}
    assert not tight.recorder.seen(PREDICT)


def test_the_overload_manager_caps_client_connections(front_factory: FrontFactory) -> None:
    tight = front_factory(TrafficSpec(overload=Overload(max_downstream_connections=5)))
    stats = tight.admin.counters("overload.")
    assert any("fixed_heap" in name for name in stats), sorted(stats)
    sockets = []
    try:
        for _ in range(12):
            sockets.append(socket.create_connection((tight.spec.host, tight.spec.ports.edge)))

        def overflowed() -> int:
            counters = tight.admin.counters("listener.")
            overflow = "downstream_global_cx_overflow"
            return sum(v for k, v in counters.items() if k.endswith(overflow))

        assert wait_until(overflowed, "Envoy refusing connections past its limit") >= 1
    finally:
        for sock in sockets:
            sock.close()
