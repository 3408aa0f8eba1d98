"""Many versions in one replica under a memory budget: what an on-demand pool's server keeps.

A pool with `load: on_demand` (or a `memory_budget`, which implies it; `spec.PoolSpec`)
loads each version on its first call instead of at start (`ModelRepository.acquire`), and,
with a budget, evicts the least recently used idle version when a load would pass it. This
module holds the policy and the measure of what a version costs; the repository applies
them.

**What a version costs.** The bytes of its weights: every parameter and buffer tensor of
the loaded module, each storage counted once (tied weights share one). The alternative, the
process's RSS before and after the load, is not robust on a shared server: loads of other
versions and calls run at the same time in the same process, the allocator keeps freed
pages (an eviction would not show), and torch's first load maps its own libraries. The
weights are what grows with the number of versions held; the rest of a version (its code,
a batch's activations, a few MiB of interpreter state per module) is small beside them for
any model worth a budget, and the budget is kept below the box's memory by that margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# A failed on-demand load is answered again, without a new load, for this long: a version
# whose artifact is refused would otherwise cost a registry download and a parse per call.
# Short enough that a registry back after a blip serves the version's next callers.
RETRY_AFTER_S = 5.0
# How long a load waits for room when every held version has calls in flight or queued
# (none may be evicted); then it fails UNAVAILABLE and the caller (or Envoy) retries. Calls
# are answered in milliseconds, so a replica that stays full this long is overloaded.
ROOM_WAIT_S = 30.0
# On-demand loads a server runs at once. A load is CPU-bound (download, parse, warm-up, a
# check) on cores the calls share, and holds its room in the budget while it runs: one at
# a time measured the best hit ratio and req/s on the bench (`servemesh bench pool`).
PARALLEL_LOADS = 1


@dataclass
class OnDemand:
    """An on-demand repository's settings: its budget (None: load on demand, never evict)."""

    budget_bytes: int | None = None
    parallel_loads: int = PARALLEL_LOADS
    retry_after_s: float = RETRY_AFTER_S
    room_wait_s: float = ROOM_WAIT_S


@dataclass
class OnDemandStats:
    """What a scrape and the bench read: calls that found their version loaded (hits) or
    waited for a load (misses), loads, evictions and every finished load's seconds."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    load_failures: int = 0
    evictions: int = 0
    load_seconds_sum: float = 0.0


def weight_bytes(module: Any) -> int:
    """Bytes of the parameters and buffers of a loaded module (an ONNX session's own count
    of its initializers; 0 for a plain callable)."""
    if not isinstance(module, torch.nn.Module):
        own = getattr(module, "weight_bytes", 0)
        return own if isinstance(own, int) else 0
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        storage = tensor.untyped_storage()
        # Tied and viewed tensors share a storage: count it once, whole.
        key = (str(tensor.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
