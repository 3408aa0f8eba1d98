"""What every servemesh service shares: bootstrap, health, reflection, drain, deadlines, logs."""

from servemesh.services.runtime.deadlines import DeadlineBudget, downstream_timeout
from servemesh.services.runtime.logs import bind_request_id, configure_logging, request_id_from
from servemesh.services.runtime.server import ServiceServer, run_service

__all__ = [
    "DeadlineBudget",
    "ServiceServer",
    "bind_request_id",
    "configure_logging",
    "downstream_timeout",
    "request_id_from",
    "run_service",
]
