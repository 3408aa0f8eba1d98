"""What must hold while the campaign runs: the mesh's processes stay alive and bounded in
memory, and valid Predicts sent alongside keep succeeding."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from servemesh.contract.wire import GATEWAY_SERVICE, method_path
from servemesh.identity import Dial
from servemesh.observe.cpu import rss_bytes
from servemesh_api.gateway.v1 import gateway_pb2

PREDICT = method_path(GATEWAY_SERVICE, "Predict")


@dataclass
class MemoryWatch:
    """Samples every watched process's RSS on a thread of its own: baseline and peak."""

    pids: Mapping[str, int]
    every_s: float = 0.25
    baseline: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        for name, pid in self.pids.items():
            rss = rss_bytes(pid)
            if rss is not None:
                self.baseline[name] = self.peak[name] = rss
        self._thread = threading.Thread(target=self._run, name="fuzz-rss", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def sample(self) -> None:
        for name, pid in self.pids.items():
            rss = rss_bytes(pid)
            if rss is not None:
                self.peak[name] = max(self.peak.get(name, rss), rss)

    def growth(self, name: str) -> int:
        return self.peak.get(name, 0) - self.baseline.get(name, 0)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()


@dataclass
class ValidTrickle:
    """Sends one real Predict through the edge every `every_s` until stopped; every one
    must succeed, whatever the fuzzed calls beside it do."""

    edge: Dial
    model: str
    entities: Sequence[str]
    metadata: tuple[tuple[str, str], ...] = ()
    every_s: float = 0.1
    timeout_s: float = 5.0
    sent: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fuzz-trickle", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        with self.edge.channel() as channel:
            predict = channel.unary_unary(
                PREDICT,
                request_serializer=gateway_pb2.PredictRequest.SerializeToString,
                response_deserializer=gateway_pb2.PredictResponse.FromString,
            )
            while not self._stop.is_set():
                entity = self.entities[self.sent % len(self.entities)]
                request = gateway_pb2.PredictRequest(model=self.model, entity_ids=[entity])
                self.sent += 1
                try:
                    reply = predict(request, timeout=self.timeout_s, metadata=self.metadata)
                    if len(reply.scores) != 1:
                        self.failures.append(f"{len(reply.scores)} scores for one entity")
                except grpc.RpcError as exc:
                    self.failures.append(f"{exc.code().name}: {exc.details()}")
                self._stop.wait(self.every_s)
