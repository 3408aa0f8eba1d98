"""The gateway's sticky bucket and its per-version metrics, without a network."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry

from servemesh.contract.wire import BUCKETS, SCORE_BUCKETS
from servemesh.services.gateway.metrics import PredictMetrics
from servemesh.services.gateway.predict import plan_predict, sticky_bucket
from servemesh.spec import MeshSpec
from servemesh_api.gateway.v1 import gateway_pb2
from tests.gateway.test_named_inputs import SPEC as WINE_SPEC
from tests.gateway.test_named_inputs import wine_request

SPEC = MeshSpec()


def test_the_bucket_is_fixed_by_the_entity_and_model_alone() -> None:
    # Pinned values: a change of the hash would move every entity mid-canary.
    assert sticky_bucket("fraud", "user-42") == 4822
    assert sticky_bucket("fraud", "user-43") == 6772
    assert sticky_bucket("wine", "user-42") == 6428
    assert all(0 <= sticky_bucket("fraud", f"u{i}") < BUCKETS for i in range(1000))


def test_buckets_spread_evenly_and_independently_per_model() -> None:
    ids = [f"user-{i}" for i in range(20_000)]
    tenths = [0] * 10
    for entity in ids:
        tenths[sticky_bucket("fraud", entity) * 10 // BUCKETS] += 1
    assert all(abs(n / len(ids) - 0.1) < 0.01 for n in tenths), tenths
    # The 10% canary of one model is not the 10% canary of another.
    both = sum(
        sticky_bucket("fraud", e) < BUCKETS // 10 and sticky_bucket("other", e) < BUCKETS // 10
        for e in ids
    )
    assert abs(both / len(ids) - 0.01) < 0.005, both


def test_a_plan_has_the_bucket_of_its_first_entity_and_none_when_pinned_or_without_one() -> None:
    plan = plan_predict(
        gateway_pb2.PredictRequest(model="fraud", entity_ids=["user-42", "user-7"]), SPEC
    )
    assert plan.bucket == sticky_bucket("fraud", "user-42")
    pinned = gateway_pb2.PredictRequest(model="fraud", version="v1", entity_ids=["user-42"])
    assert plan_predict(pinned, SPEC).bucket is None
    rows_only = gateway_pb2.PredictRequest(
        model="fraud", rows=[gateway_pb2.FeatureRow(values=[0.0] * 64)]
    )
    assert plan_predict(rows_only, SPEC).bucket is None
    # A model of several entities: the first view's first row.
    wine = plan_predict(wine_request(), WINE_SPEC)
    assert wine.bucket == sticky_bucket("wine", wine.reads[0].entity_ids[0])


def test_scores_and_model_calls_are_counted_per_version() -> None:
    registry = CollectorRegistry()
    metrics = PredictMetrics(registry)
    metrics.record_scores("fraud", "v2", [0.01, 0.5, 0.97, math.nan, 250.0])
    metrics.record_scores("fraud", "v2", [])
    metrics.record_model_call("fraud", "v2", "OK")
    metrics.record_model_call("fraud", "v2", "INTERNAL")
    metrics.record_model_call("fraud", "v2", "INTERNAL")

    def bucket(le: str) -> float | None:
        return registry.get_sample_value(
            "servemesh_gateway_prediction_score_bucket",
            {"model": "fraud", "version": "v2", "le": le, "route": "routed"},
        )

    assert bucket("0.05") == 1 and bucket("0.5") == 2 and bucket("1.0") == 3
    # NaN and a score past the top bound land in +Inf only: every score is in a bucket.
    assert bucket("100.0") == 3 and bucket("+Inf") == 5
    assert len(SCORE_BUCKETS) == len(set(SCORE_BUCKETS)) == 27
    calls = {
        code: registry.get_sample_value(
            "servemesh_gateway_model_calls_total",
            {"model": "fraud", "version": "v2", "code": code, "route": "routed"},
        )
        for code in ("OK", "INTERNAL")
    }
    assert calls == {"OK": 1, "INTERNAL": 2}
