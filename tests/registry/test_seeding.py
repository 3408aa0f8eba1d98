"""Seeding a registry that already holds the demo: the same bytes are success, other bytes
a one-line error that names the fix."""

from __future__ import annotations

import pytest

from servemesh.seeding import SeedConflict, seed_demo
from servemesh.spec import DemoSpec, MeshSpec, ModelSpec, ModelVersionSpec, ResolvedSpec, resolve
from tests.registry.registry_kit import RunningRegistry


def spec_with(source: str) -> ResolvedSpec:
    """The demo model with one version built from `source`; no features to write."""
    model = ModelSpec(versions={"v1": ModelVersionSpec(source=source)}, traffic={"v1": 100})
    return resolve(MeshSpec(models={"fraud": model}, demo=DemoSpec(entities=0)))


async def test_seeding_twice_finds_its_own_version_and_succeeds(registry: RunningRegistry) -> None:
    await seed_demo(spec_with("demo:1"), registry.channel)
    first = registry.store.get_version("fraud", "v1")
    await seed_demo(spec_with("demo:1"), registry.channel)
    assert registry.store.get_version("fraud", "v1") == first


async def test_a_version_with_other_bytes_is_a_one_line_error_naming_the_fix(
    registry: RunningRegistry,
) -> None:
    await seed_demo(spec_with("demo:1"), registry.channel)
    with pytest.raises(SeedConflict) as caught:
        await seed_demo(spec_with("demo:2"), registry.channel)
    message = str(caught.value)
    assert "\n" not in message
    assert "fraud/v1" in message and "fresh state dir" in message
    assert registry.store.get_version("fraud", "v1").labels["source"] == "demo:1"
