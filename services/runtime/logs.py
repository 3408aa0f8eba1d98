"""Structured JSON logs, one object a line, carrying the request id of the call in flight.

Lines about single requests that went well (the gateway's "predict" line) are off unless
asked for (`configure_logging(..., request_logs=True)`, a service's `--request-logs`):
formatting and writing one costs a call ~45 µs of CPU, more than the server's whole call
path, on every call of every replica. Their warnings and errors (a degraded answer, a
refusal, a failure) are always written; so is everything else at the configured level.
"""

from __future__ import annotations

import contextvars
import json
import logging
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from servemesh.contract.wire import REQUEST_ID_HEADER

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")

# Fields of a LogRecord that are not the caller's `extra=`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(time.time(), 6),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = _request_id.get()
        if request_id:
            entry["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


# Loggers whose INFO lines are one per request served (the gateway's "predict" line).
REQUEST_LOGGERS = ("servemesh.services.gateway.service",)


def configure_logging(service: str, level: str = "INFO", *, request_logs: bool = False) -> None:
    """JSON lines on stderr at `level`; the per-request lines of `REQUEST_LOGGERS` only when
    `request_logs` (otherwise those loggers write from WARNING up)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    set_request_logs(request_logs)


def set_request_logs(on: bool) -> None:
    """Write the per-request INFO lines (on) or not (off: their loggers start at WARNING,
    so a call's `log.info` returns before a record is even made)."""
    floor = max(logging.WARNING, logging.getLogger().getEffectiveLevel())
    for name in REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if on else floor)


def request_id_from(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The caller's x-request-id, or a fresh one when it sent none."""
    for key, value in metadata or ():
        if key == REQUEST_ID_HEADER and value:
            text = value.decode() if isinstance(value, bytes) else value
            # Bound what a caller can make us log.
            return text[:128]
    return new_request_id()


def new_request_id() -> str:
    """A fresh id: 128 random bits as 32 hex digits (uuid4's shape, at a tenth of its cost:
    ids need to be unique, not unpredictable)."""
    return f"{random.getrandbits(128):032x}"


def bind_request_id(request_id: str) -> contextvars.Token[str]:
    return _request_id.set(request_id)


def current_request_id() -> str:
    return _request_id.get()
