"""Deadline propagation: every downstream call gets what is left of the caller's time."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from servemesh.services.runtime.errors import DeadlineExceeded


class DeadlineExhausted(DeadlineExceeded):
    """The caller's deadline leaves no time for the next hop."""


@dataclass(frozen=True)
class DeadlineBudget:
    """How much of a caller's remaining time a hop keeps for itself."""

    hop_budget_s: float = 0.002
    default_timeout_s: float = 5.0

    def absolute_deadline(self, context: grpc.aio.ServicerContext) -> float:
        """The caller's deadline on the monotonic clock (default when it gave none)."""
        remaining = context.time_remaining()
        if remaining is None:
            remaining = self.default_timeout_s
        return time.monotonic() + remaining

    def remaining(self, deadline: float) -> float:
        """Seconds a downstream call may take; raises when nothing is left after our budget."""
        left = deadline - time.monotonic() - self.hop_budget_s
        if left <= 0:
            left_ms = (deadline - time.monotonic()) * 1000
            raise DeadlineExhausted(f"deadline exceeded: {left_ms:.1f} ms left for the next hop")
        return left


def downstream_timeout(context: grpc.aio.ServicerContext, budget: DeadlineBudget) -> float:
    """Timeout for a downstream call made now on behalf of `context`'s caller."""
    return budget.remaining(budget.absolute_deadline(context))
