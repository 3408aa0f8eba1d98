"""Feature views in the mesh spec: the demo's default, and errors that name the field."""

from __future__ import annotations

import pytest

from servemesh.contract.demo import DEMO_FEATURES
from servemesh.spec import FeatureViewSpec, MeshSpec, SpecError, parse_spec
from servemesh.spec.durations import duration_seconds


def test_the_default_spec_has_the_demo_user_view() -> None:
    spec = MeshSpec()
    assert set(spec.feature_views) == {"user"}
    user = spec.feature_views["user"]
    assert user.features == DEMO_FEATURES
    assert (user.max_age, user.staleness, user.allow_nan, user.defaults) == (
        None,
        "error",
        False,
        {},
    )
    assert spec.models["fraud"].feature_view == "user"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90.0), ("15m", 900.0), ("24h", 86400.0), ("7d", 604800.0), ("1h30m", 5400.0)],
)
def test_max_age_reads_as_a_duration(text: str, seconds: float) -> None:
    assert duration_seconds(text) == seconds
    assert FeatureViewSpec(max_age=text).max_age_ms == round(seconds * 1000)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "feature_views: {user: {features: [f00], max_age: 1 day}}\n",
            "feature_views.user.max_age: String should match pattern",
        ),
        (
            "feature_views: {user: {staleness: maybe}}\n",
            "feature_views.user.staleness: Input should be 'error', 'default' or 'degraded'",
        ),
        (
            "feature_views: {user: {features: [a, b, a]}}\n",
            "feature_views.user: Value error, features: named more than once: ['a']",
        ),
        (
            "feature_views: {user: {features: [a], defaults: {z: 1}}}\n",
            "feature_views.user: Value error, defaults: not features of the view: ['z']",
        ),
        (
            "feature_views: {user: {max_age: 0s}}\n",
            "max_age: must be longer than 0",
        ),
        (
            "feature_views: {other: {}}\n",
            "models.fraud.feature_view: 'user' is not one of feature_views ['other']",
        ),
        (
            "feature_views: {user: {features: [f00, f01]}}\n",
            "models.fraud.features: not in feature view 'user': ['f02', 'f03'",
        ),
    ],
)
def test_bad_views_are_refused_naming_the_field(text: str, expected: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(text, "mesh.yaml")
    assert expected in str(err.value)


def test_a_view_may_take_its_features_from_the_loaded_file() -> None:
    spec = parse_spec(
        "feature_views:\n"
        "  user: {features: null, max_age: 24h, staleness: degraded, allow_nan: true}\n",
        "mesh.yaml",
    )
    view = spec.feature_views["user"]
    assert view.features is None and view.max_age_ms == 86_400_000
