"""Seeding a registry that already holds the demo: the same bytes are success, other bytes
a one-line error that names the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from servemesh.seeding import SeedConflict, seed_demo
from servemesh.spec import DemoSpec, MeshSpec, ModelSpec, ModelVersionSpec, ResolvedSpec, resolve
from tests.control_kit import install_test_token
from tests.registry.registry_kit import RunningRegistry


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """A state dir holding the credential the test registry checks (seeding reads it)."""
    install_test_token(tmp_path / "state")
    return tmp_path / "state"


def spec_with(source: str, state_dir: Path) -> ResolvedSpec:
    """The demo model with one version built from `source`; no features to write."""
    model = ModelSpec(versions={"v1": ModelVersionSpec(source=source)}, traffic={"v1": 100})
    return resolve(
        MeshSpec(models={"fraud": model}, demo=DemoSpec(entities=0), state_dir=str(state_dir))
    )


async def test_seeding_twice_finds_its_own_version_and_succeeds(
    registry: RunningRegistry, state_dir: Path
) -> None:
    await seed_demo(spec_with("demo:1", state_dir), registry.channel)
    first = registry.store.get_version("fraud", "v1")
    await seed_demo(spec_with("demo:1", state_dir), registry.channel)
    assert registry.store.get_version("fraud", "v1") == first


async def test_a_version_with_other_bytes_is_a_one_line_error_naming_the_fix(
    registry: RunningRegistry, state_dir: Path
) -> None:
    await seed_demo(spec_with("demo:1", state_dir), registry.channel)
    with pytest.raises(SeedConflict) as caught:
        await seed_demo(spec_with("demo:2", state_dir), registry.channel)
    message = str(caught.value)
    assert "\n" not in message
    assert "fraud/v1" in message and "fresh state dir" in message
    assert registry.store.get_version("fraud", "v1").labels["source"] == "demo:1"
