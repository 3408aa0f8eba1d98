"""A short fuzz campaign on a real mesh: every public RPC, through Envoy and directly.

The long one is `servemesh fuzz --requests 10000` (docs/security.md, "Fuzzing").
"""

from __future__ import annotations

import pytest

from servemesh.fuzz.campaign import run_campaign
from servemesh.fuzz.rpcs import RPCS
from servemesh.launcher import Mesh

pytestmark = pytest.mark.mesh


def test_a_short_campaign_finds_nothing_and_valid_predicts_keep_succeeding(
    fuzz_mesh: Mesh,
) -> None:
    requests = 12 * len(RPCS)
    report = run_campaign(fuzz_mesh, requests, seed=1)

    assert report.requests == requests
    for name, tally in report.rpcs.items():
        assert tally.requests >= 10, name
        assert sum(tally.statuses.values()) == tally.requests, name
    vias = {via for tally in report.rpcs.values() for via in tally.by_via}
    assert vias == {"envoy", "direct"}
    assert report.findings == [], [f.__dict__ for f in report.findings]
    assert report.dead == {}
    assert report.over_bound() == {}
    assert report.valid_sent > 0
    assert report.valid_failures == []
    assert report.ok
