"""Replica-level fault injection for drills and tests: errors and delays on this replica only.

Envoy's fault filter acts on a route, before a host is picked; this acts on one replica,
after Envoy chose it, which is what "a replica that fails every call" or "zone-a's
endpoints are slow" need. Health checks and reflection are never faulted, so a faulty
replica still looks healthy to active checks and only outlier detection can catch it.

Control: a JSON file per instance (`<state_dir>/faults/<instance>.json`), polled; the
replica acknowledges each change in `<state_dir>/faults/applied/<instance>.json` with the
same `version`. The acknowledgements have a folder of their own: model servers running as
a user of their own may write there, and only read the control files (one could otherwise
set another service's faults).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from servemesh.contract.atomic import atomic_write_text
from servemesh.contract.wire import HEALTH_PREFIX, REFLECTION_PREFIX

log = logging.getLogger(__name__)

EXEMPT_PREFIXES = (HEALTH_PREFIX, REFLECTION_PREFIX)


@dataclass(frozen=True)
class FaultSettings:
    error_percent: float = 0.0
    error_code: str = "UNAVAILABLE"
    delay_percent: float = 0.0
    delay_ms: float = 0.0
    version: str = ""

    @property
    def active(self) -> bool:
        return self.error_percent > 0 or (self.delay_percent > 0 and self.delay_ms > 0)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FaultSettings:
        settings = cls(
            error_percent=float(data.get("error_percent", 0)),
            error_code=str(data.get("error_code", "UNAVAILABLE")).upper(),
            delay_percent=float(data.get("delay_percent", 0)),
            delay_ms=float(data.get("delay_ms", 0)),
            version=str(data.get("version", "")),
        )
        if not 0 <= settings.error_percent <= 100 or not 0 <= settings.delay_percent <= 100:
            raise ValueError("error_percent and delay_percent must be within 0..100")
        if settings.delay_ms < 0:
            raise ValueError("delay_ms must not be negative")
        if settings.error_code not in grpc.StatusCode.__members__ or settings.error_code == "OK":
            raise ValueError(f"error_code {settings.error_code!r} is not a gRPC error status")
        return settings


def is_faultable(method: str) -> bool:
    """Whether calls of `method` may be faulted: not health checks or reflection."""
    return not method.startswith(EXEMPT_PREFIXES)


class FaultInjector:
    """The current fault settings of this replica, applied to its unary calls (the serving
    path) by the server's call path: `if faults.settings.active: await faults.inject(...)`,
    one attribute read per call while no fault is set."""

    def __init__(self) -> None:
        self.settings = FaultSettings()
        self.faulted = 0

    async def inject(self, context: grpc.aio.ServicerContext) -> None:
        """Delay the call and/or end it with the injected error, as the settings draw."""
        settings = self.settings
        if settings.delay_ms and random.uniform(0, 100) < settings.delay_percent:
            await asyncio.sleep(settings.delay_ms / 1000)
        if random.uniform(0, 100) < settings.error_percent:
            self.faulted += 1
            await context.abort(grpc.StatusCode[settings.error_code], "injected fault")

    async def watch(self, control: Path, interval_s: float = 0.1) -> None:
        """Follow the control file until cancelled; a malformed file is logged and ignored."""
        seen: float | None = None
        while True:
            try:
                mtime = control.stat().st_mtime
            except FileNotFoundError:
                mtime = None
            if mtime != seen:
                seen = mtime
                self._load(control)
            await asyncio.sleep(interval_s)

    def _load(self, control: Path) -> None:
        try:
            settings = (
                FaultSettings.from_json(json.loads(control.read_text()))
                if control.exists()
                else FaultSettings()
            )
        except (OSError, ValueError) as exc:
            log.warning(
                "fault control file ignored", extra={"path": str(control), "error": str(exc)}
            )
            return
        self.settings = settings
        if settings.active:
            log.warning("fault settings applied", extra=asdict(settings))
        else:
            log.info("fault settings cleared")
        ack = ack_file(control)
        try:
            ack.parent.mkdir(exist_ok=True)
            _atomic_write_json(ack, asdict(settings))
        except OSError as exc:  # applied all the same; the drill waiting on it says so
            log.warning("fault settings not acknowledged", extra={"error": str(exc)})


def _atomic_write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_text(path, json.dumps(data))


def control_file(state_dir: Path, instance: str) -> Path:
    return Path(state_dir) / "faults" / f"{instance}.json"


# Where replicas acknowledge their control file's settings (the state dir grants the
# model servers' group write access to it, and only read access to the control files).
APPLIED_DIR = "applied"


def ack_file(control: Path) -> Path:
    return control.parent / APPLIED_DIR / control.name


def set_fault(
    state_dir: Path, instance: str, settings: FaultSettings | None, *, wait_s: float = 5.0
) -> FaultSettings:
    """Give a replica new fault settings (None clears them) and wait for its acknowledgement."""
    version = uuid.uuid4().hex
    data = asdict(settings or FaultSettings())
    data["version"] = version
    FaultSettings.from_json(data)  # refuse bad settings here, not in the replica
    path = control_file(state_dir, instance)
    _atomic_write_json(path, data)
    ack = ack_file(path)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if json.loads(ack.read_text()).get("version") == version:
                return FaultSettings.from_json(data)
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise TimeoutError(f"{instance} did not acknowledge fault settings within {wait_s:.0f} s")
