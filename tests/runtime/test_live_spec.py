"""A service follows its resolved spec file: changes reach the hooks, bad files do not."""

from __future__ import annotations

from pathlib import Path

from servemesh.contract.atomic import atomic_write_text
from servemesh.services.runtime.live_spec import LiveSpec
from servemesh.spec import MeshSpec, ResolvedSpec, dump_spec, resolve


def _written(path: Path, spec: ResolvedSpec) -> ResolvedSpec:
    atomic_write_text(path, dump_spec(spec))
    return spec


async def test_a_change_reaches_every_hook_once(tmp_path: Path) -> None:
    path = tmp_path / "mesh.resolved.yaml"
    first = _written(path, resolve(MeshSpec(state_dir=str(tmp_path))))
    live = LiveSpec(path, first)
    seen: list[tuple[str, dict[str, int]]] = []

    async def hook(spec: ResolvedSpec) -> None:
        seen.append(("hook", dict(spec.models["fraud"].traffic)))

    live.on_change(hook)
    assert not await live.refresh(), "an unchanged file is not a change"

    fraud = first.models["fraud"].model_copy(update={"traffic": {"v1": 50, "v2": 50}})
    _written(path, first.model_copy(update={"models": {"fraud": fraud}}))
    assert await live.refresh()
    assert live.current.models["fraud"].traffic == {"v1": 50, "v2": 50}
    assert live.generation == 1
    assert seen == [("hook", {"v1": 50, "v2": 50})]
    assert not await live.refresh(), "the same content is taken once"


async def test_a_file_that_does_not_parse_keeps_the_last_good_spec(tmp_path: Path) -> None:
    path = tmp_path / "mesh.resolved.yaml"
    first = _written(path, resolve(MeshSpec(state_dir=str(tmp_path))))
    live = LiveSpec(path, first)
    calls: list[ResolvedSpec] = []

    async def hook(spec: ResolvedSpec) -> None:
        calls.append(spec)

    live.on_change(hook)
    atomic_write_text(path, "models: {fraud: {traffic: {v9: 100}}}\n")
    assert not await live.refresh()
    assert live.current == first
    assert calls == []


async def test_a_failing_hook_does_not_stop_the_others(tmp_path: Path) -> None:
    path = tmp_path / "mesh.resolved.yaml"
    first = _written(path, resolve(MeshSpec(state_dir=str(tmp_path))))
    live = LiveSpec(path, first)
    reached: list[int] = []

    async def broken(spec: ResolvedSpec) -> None:
        raise RuntimeError("boom")

    async def fine(spec: ResolvedSpec) -> None:
        reached.append(live.generation)

    live.on_change(broken)
    live.on_change(fine)
    _written(path, first.model_copy(update={"name": "renamed"}))
    assert await live.refresh()
    assert reached == [1]
