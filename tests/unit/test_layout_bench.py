"""`servemesh bench layout`'s arithmetic: each arm's figures over its repeats, and the
ratios of each later arm to the first, taken per repeat; the arms' specs."""

from __future__ import annotations

import pytest

from servemesh.bench.layout import LayoutRound, arm_spec, as_report, bench_layout, summarize
from servemesh.bench.report import emit
from servemesh.contract.errors import UsageError
from servemesh.spec import MeshSpec, Replicas


def _round(arm: str, repeat: int, rss: float, idle: float, rps: float) -> LayoutRound:
    return LayoutRound(
        arm=arm,  # type: ignore[arg-type]
        repeat=repeat,
        startup_s=5.0,
        startup_cpu_s=9.0,
        envoys=1,
        processes=8,
        rss_mib={"model": rss / 2, "envoy": rss / 2},
        idle_cpu_ms_per_s={"model": idle},
        p50_ms_c1=4.0,
        rps=rps,
        p99_ms=40.0,
        errors=0,
    )


def test_each_later_arm_is_divided_by_the_first_within_each_repeat() -> None:
    rounds = [
        _round("per_zone", 0, 1400.0, 100.0, 800.0),
        _round("shared", 0, 1260.0, 90.0, 800.0),
        _round("small-host", 0, 700.0, 50.0, 1000.0),
        _round("shared", 1, 1300.0, 120.0, 600.0),
        _round("small-host", 1, 650.0, 60.0, 900.0),
        _round("per_zone", 1, 1500.0, 130.0, 700.0),
        # A repeat the run did not finish: its arms count in the medians, in no ratio.
        _round("per_zone", 2, 1450.0, 110.0, 750.0),
    ]
    figures = summarize(rounds, ("per_zone", "shared", "small-host"))
    memory = figures["memory (RSS)"]
    assert isinstance(memory, dict)
    assert memory["per_zone"]["median"] == 1450.0
    assert memory["small-host"] == {"median": 675.0, "min": 650.0, "max": 700.0, "spread": 0.074}
    assert memory["ratios_to_first"]["shared"]["per_repeat"] == [0.9, 0.867]
    assert memory["ratios_to_first"]["small-host"]["per_repeat"] == [0.5, 0.433]
    assert memory["ratios_to_first"]["small-host"]["median"] == 0.467
    rps = figures["req/s"]
    assert isinstance(rps, dict)
    assert rps["ratios_to_first"]["small-host"]["per_repeat"] == [1.25, 1.286]
    assert "per_zone" not in rps["ratios_to_first"]


def test_the_report_prints_every_arm_and_its_ratio_to_the_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    arms = ["shared", "small-host"]
    rounds = [_round("shared", 0, 1200.0, 70.0, 800.0), _round("small-host", 0, 900.0, 50.0, 900.0)]
    report = {
        "arms": arms,
        "repeats": 1,
        "idle_s": 10.0,
        "seconds": 4.0,
        "concurrency": 16,
        "figures": summarize(rounds, arms),  # type: ignore[arg-type]
    }
    emit(as_report(report), json_stdout=False, json_out=None)
    printed = capsys.readouterr().out
    assert "small-host: one feature and one model process for every zone" in printed
    memory = next(line for line in printed.splitlines() if "memory (RSS)" in line)
    assert "1200.0 (1200.0-1200.0)" in memory and "0.75x (0.75)" in memory


def test_the_arms_shape_the_spec_and_two_different_ones_are_needed() -> None:
    small = MeshSpec(profile="small-host")
    assert arm_spec(small, "per_zone") == MeshSpec()
    assert arm_spec(small, "shared").proxy.layout == "shared"
    assert arm_spec(small, "shared").feature.per_zone == {"zone-a": 1, "zone-b": 1}
    assert arm_spec(MeshSpec(), "small-host") == small
    # A layout arm keeps the spec's own processes per zone.
    two = MeshSpec(model_servers=Replicas(per_zone={"zone-a": 2, "zone-b": 2}))
    assert arm_spec(two, "shared").model_servers.per_zone == {"zone-a": 2, "zone-b": 2}
    # exec: the default layout, only the fork server off.
    execd = arm_spec(small, "exec")
    assert execd.processes.fork_server is False and MeshSpec().processes.fork_server is True
    assert execd.model_copy(update={"processes": MeshSpec().processes}) == MeshSpec()
    with pytest.raises(UsageError, match="two or more different"):
        bench_layout(MeshSpec(), arms=("shared", "shared"))


def test_one_edge_and_replicated_change_one_part_each_and_the_rest_run_one_redis() -> None:
    # A spec asking for a replicated store (as mesh.yaml does) runs one Redis in every arm
    # but `replicated`, so each arm differs from per_zone in one part.
    asked = MeshSpec.model_validate({"feature_store": {"topology": "replicated"}})
    per_zone = arm_spec(asked, "per_zone")
    assert per_zone.feature_store.topology == "single"
    assert per_zone.edges_per_zone and per_zone.registry_mirror_zones() == ["zone-b"]
    one_edge = arm_spec(asked, "one-edge")
    assert not one_edge.edges_per_zone and one_edge.registry_mirror_zones() == []
    assert one_edge.feature_store == per_zone.feature_store
    replicated = arm_spec(asked, "replicated")
    assert replicated.feature_store.topology == "replicated"
    assert replicated.proxy == per_zone.proxy and replicated.registry == per_zone.registry


def test_the_command_offers_the_benchs_arms_and_its_default() -> None:
    from servemesh.bench.layout import ARMS, DEFAULT_ARMS
    from servemesh.cli import build_parser

    args = build_parser().parse_args(["bench", "layout"])
    assert tuple(args.arms) == DEFAULT_ARMS
    for arm in ARMS:
        assert (
            build_parser().parse_args(["bench", "layout", "--arms", "shared", arm]).arms[1] == arm
        )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "layout", "--arms", "shared", "tiny"])
