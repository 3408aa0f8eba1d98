"""`servemesh fuzz` is registered with its options, and its report's JSON says what ran."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from servemesh.cli import build_parser
from servemesh.fuzz.campaign import CampaignReport, Finding, RpcTally
from servemesh.fuzz.report import write_json


def test_the_fuzz_command_takes_requests_seed_and_a_json_file() -> None:
    args = build_parser().parse_args(
        ["fuzz", "--requests", "300", "--seed", "4", "--json-out", "out.json"]
    )
    assert (args.requests, args.seed, args.json_out) == (300, 4, "out.json")
    assert build_parser().parse_args(["fuzz"]).requests == 10_000


def test_the_json_report_holds_statuses_findings_and_the_verdict(tmp_path: Path) -> None:
    tally = RpcTally("model", control=True, requests=3)
    tally.statuses.update({"NOT_FOUND": 2, "UNKNOWN": 1})
    tally.by_via.update({"envoy": 2, "direct": 1})
    report = CampaignReport(
        requests=3,
        seed=4,
        duration_s=1.0,
        rpcs={"GRPCInferenceService/RepositoryModelUnload": tally},
        findings=[
            Finding(
                "GRPCInferenceService/RepositoryModelUnload", "direct", "unknown", "UNKNOWN", "x", 1
            )
        ],
        dead={},
        rss_growth={"model-fraud-zone-a-0": 10, "envoy": 600 * 1024 * 1024},
        rss_bound=512 * 1024 * 1024,
        services={"model-fraud-zone-a-0": "model", "envoy": "envoy"},
        valid_sent=5,
        valid_failures=[],
    )
    path = tmp_path / "report.json"
    write_json(report, path)
    saved = json.loads(path.read_text())
    rpc = saved["rpcs"]["GRPCInferenceService/RepositoryModelUnload"]
    assert rpc["statuses"] == {"NOT_FOUND": 2, "UNKNOWN": 1}
    assert rpc["control"] is True
    assert saved["findings"][0]["kind"] == "unknown"
    assert saved["ok"] is False
    assert report.over_bound() == {"envoy": 600 * 1024 * 1024}
    assert Counter(saved["rpcs"][next(iter(saved["rpcs"]))]["via"]) == Counter(envoy=2, direct=1)
