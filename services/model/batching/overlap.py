"""Adaptive dispatch's signal: do requests arrive sooner than a batch of one completes?

Overlap is the share of arrivals that came sooner after the previous one than a batch of one
takes to run (EWMA over arrivals). It reads the arrival process only, so the dispatch policy
cannot feed it: a closed loop of one caller scores 0 (its next request waits for our answer,
and that answer took at least a batch of one), independent callers at ~1,000 req/s on the
demo MLP score ~0.4. Below OVERLAP_OFF a batch leaves at once; above OVERLAP_ON it waits for
company like Triton: a forward pass costs about the same for 1 row as for 8, so serving
overlapping requests one by one burns the CPU that request handling needs. The band between
the two keeps noise from flipping the mode (docs/benchmarks.md has the measurements).
"""

from __future__ import annotations

OVERLAP_ALPHA = 0.02
OVERLAP_ON = 0.2
OVERLAP_OFF = 0.1
SOLO_ALPHA = 0.05  # EWMA weight of each new batch-of-one timing


class ArrivalOverlap:
    """`observe(now)` at every arrival folds "this request came less than `solo_s` after the
    previous one" into an EWMA and returns whether batches should wait for company (with
    hysteresis between OVERLAP_ON and OVERLAP_OFF). `solo_s` is the wall time of a batch of
    one, learned from the batches that run (`solo(seconds)`), seeded by the warm-up.
    """

    def __init__(self, solo_s: float = 0.0) -> None:
        self.solo_s = solo_s
        self.share = 0.0
        self.company_expected = False
        self._last = float("-inf")

    def observe(self, now: float) -> bool:
        overlapped = now - self._last < self.solo_s
        self._last = now
        self.share += OVERLAP_ALPHA * (overlapped - self.share)
        threshold = OVERLAP_OFF if self.company_expected else OVERLAP_ON
        self.company_expected = self.share >= threshold
        return self.company_expected

    def solo(self, seconds: float) -> None:
        self.solo_s += (seconds - self.solo_s) * (SOLO_ALPHA if self.solo_s else 1.0)
