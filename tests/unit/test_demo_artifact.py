"""The demo artifacts are reproducible: the same seed gives the same bytes anywhere."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from servemesh.contract.demo import (
    build_fraud_model,
    canonical_torchscript,
    demo_artifact,
    demo_seed,
    heavy_artifact,
    heavy_seed,
    source_artifact,
)

EXPORT = "from servemesh.contract.demo import demo_artifact; print(demo_artifact({seed}).sha256)"
# An unrelated model with nn.Linear layers, scripted before the demo in the same process.
SCRIPT_OTHER_FIRST = (
    "import torch; "
    "torch.jit.script(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))); "
)


def exported_sha256(hash_seed: str, cwd: Path, seed: int = 3, prelude: str = "") -> str:
    """The demo artifact's sha256 as a fresh interpreter with this hash seed computes it,
    after running `prelude`."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", prelude + EXPORT.format(seed=seed)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def test_the_same_seed_gives_the_same_bytes_whatever_the_hash_seed(tmp_path: Path) -> None:
    # Before canonicalisation, the Final attributes' order followed the hash seed.
    first = exported_sha256("1", tmp_path)
    second = exported_sha256("2", tmp_path)
    assert first == second == demo_artifact(3).sha256


def test_the_archive_names_no_path_of_this_installation() -> None:
    torch_dir = str(Path(torch.__file__).parent).encode()
    with zipfile.ZipFile(io.BytesIO(demo_artifact(1).data)) as archive:
        for name in archive.namelist():
            assert torch_dir not in archive.read(name), name


def test_the_canonical_archive_computes_what_the_model_computes() -> None:
    loaded = torch.jit.load(io.BytesIO(demo_artifact(2).data))
    rows = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(rows), build_fraud_model(2)(rows))


def test_different_seeds_give_different_artifacts() -> None:
    assert demo_artifact(1).sha256 != demo_artifact(2).sha256


def test_demo_sources_name_their_seed() -> None:
    assert demo_seed("demo:7") == 7
    assert demo_seed("registry") is None


def test_what_the_process_scripted_before_does_not_change_the_bytes(tmp_path: Path) -> None:
    # TorchScript names a scripted nn.Linear after the shapes it met earlier in the process;
    # the demo network has no such class, so an unrelated model scripted first changes nothing.
    plain = exported_sha256("0", tmp_path, seed=4)
    assert exported_sha256("0", tmp_path, seed=4, prelude=SCRIPT_OTHER_FIRST) == plain


HEAVY_EXPORT = "from servemesh.contract.demo import heavy_artifact; print(heavy_artifact(5).sha256)"


# 6 s of building the heavy artifact twice, in two processes: the whole suite runs it.
@pytest.mark.slow
def test_the_heavy_artifact_is_the_same_bytes_in_another_process(tmp_path: Path) -> None:
    # `servemesh up` re-seeds a state dir with the same bytes or refuses the conflict.
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", HEAVY_EXPORT],
        env={**os.environ, "PYTHONHASHSEED": "3"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    assert done.stdout.strip() == heavy_artifact(5).sha256


def test_built_in_sources_name_their_artifact_and_its_format() -> None:
    assert heavy_seed("demo-heavy:3") == 3 and heavy_seed("demo:3") is None
    assert demo_seed("demo-heavy:3") is None
    demo = source_artifact("demo:1")
    heavy = source_artifact("demo-heavy:1")
    assert demo is not None and demo.format == "torchscript"
    assert demo.sha256 == demo_artifact(1).sha256
    assert heavy is not None and heavy.format == "torch_export"
    assert source_artifact("registry") is None
    with pytest.raises(ValueError, match="demo-heavy:<seed>"):
        heavy_seed("demo-heavy:x")


def _doubler() -> torch.nn.Module:
    # A new class each call, all of one qualified name: TorchScript mangles the second.
    class Doubler(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    return Doubler()


def _saved(module: torch.nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(module), buffer)
    return buffer.getvalue()


def test_a_class_scripted_twice_in_one_process_saves_to_the_same_bytes() -> None:
    first, second = _saved(_doubler()), _saved(_doubler())
    with zipfile.ZipFile(io.BytesIO(second)) as archive:
        assert any("___torch_mangle_" in name for name in archive.namelist())
    assert canonical_torchscript(first) == canonical_torchscript(second)
    loaded = torch.jit.load(io.BytesIO(canonical_torchscript(second)))
    assert torch.equal(loaded(torch.ones(2)), torch.full((2,), 2.0))
