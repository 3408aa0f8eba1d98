"""Record both sides of shadowed calls, so a shadow version can be compared with the primary.

Envoy marks a call whose copy goes to a shadow version with `x-servemesh-shadow-role:
primary` and the copy with `shadow` (see servemesh/proxy/render.py). The servicer
appends one JSON line per marked ModelInfer answer to a ledger file (ShadowRecorder); calls
without the mark cost nothing beyond reading their headers. `servemesh routes
shadow-report` pairs the lines by request id.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from servemesh_api.inference import grpc_service_pb2 as oip

log = logging.getLogger(__name__)

ROLES = ("primary", "shadow")


def first_output(response: oip.ModelInferResponse) -> list[float]:
    """The first output tensor of an answer as floats (raw FP32 or typed contents)."""
    if not response.outputs:
        return []
    if response.raw_output_contents:
        return np.frombuffer(response.raw_output_contents[0], dtype="<f4").astype(float).tolist()
    return list(response.outputs[0].contents.fp32_contents)


class ShadowLedger:
    """An append-only JSON-lines file, rolled over to `<name>.1` past `max_bytes`."""

    def __init__(self, path: Path, max_bytes: int = 64 * 1024 * 1024) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._file: TextIO | None = None

    def append(self, entry: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1)  # line-buffered: readers see whole lines
        self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")
        if self._file.tell() > self.max_bytes:
            self._file.close()
            self.path.replace(self.path.with_name(self.path.name + ".1"))
            self._file = None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ShadowRecorder:
    """Writes one ledger line per answer of a call Envoy marked primary or shadow.

    Called by the servicer's ModelInfer, which reads the mark with the call's other
    headers (no interceptor: unmarked calls pay nothing here).
    """

    def __init__(self, ledger: ShadowLedger, replica: str) -> None:
        self.ledger = ledger
        self.replica = replica

    async def record(
        self,
        role: str,
        request_id: str,
        routed: str,
        request: oip.ModelInferRequest,
        answer: Awaitable[oip.ModelInferResponse],
    ) -> oip.ModelInferResponse:
        """`answer`'s response (or exception), with a ledger line written for it.

        Envoy names the version on both sides (the split's pick, the shadow's re-mark): a
        failed call is recorded against it, which a rollout's shadow step compares.
        """
        started = time.perf_counter()
        entry: dict[str, Any] = {"role": role, "request_id": request_id, "replica": self.replica}
        try:
            response = await answer
        except BaseException as exc:
            entry |= {
                "model": request.model_name,
                "version": request.model_version or routed,
                "error": type(exc).__name__,
            }
            self._append(entry, started)
            raise
        entry |= {
            "model": response.model_name,
            "version": response.model_version,
            "scores": first_output(response),
        }
        self._append(entry, started)
        return response

    def _append(self, entry: dict[str, Any], started: float) -> None:
        entry["ms"] = round((time.perf_counter() - started) * 1000, 3)
        try:
            self.ledger.append(entry)
        except OSError as exc:  # the comparison is best effort; the answer is not
            log.warning("shadow ledger write failed", extra={"error": str(exc)})


def ledger_path(state_dir: Path, instance: str) -> Path:
    return Path(state_dir) / "shadow" / f"{instance}.jsonl"
