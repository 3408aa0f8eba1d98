"""ModelRunner: verified loading, inference-mode forward passes, warm-up timings."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from servemesh.contract.demo import Artifact
from servemesh.services.model.runner import ArtifactMismatch, ModelRunner, verify_artifact
from tests.model.model_helpers import FEATURES, array_of, rows


def load(artifact: Artifact, **kwargs: Any) -> ModelRunner:
    return ModelRunner.from_bytes(
        artifact.data,
        sha256=artifact.sha256,
        model="fraud",
        version="v1",
        row_shape=(FEATURES,),
        **kwargs,
    )


def test_tampered_artifact_is_refused_before_torch_parses_it(
    artifacts: dict[int, Artifact], monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.jit.load reached with unverified bytes")

    monkeypatch.setattr(torch.jit, "load", must_not_load)
    tampered = bytearray(artifacts[1].data)
    tampered[len(tampered) // 2] ^= 0xFF
    with pytest.raises(ArtifactMismatch, match="does not match"):
        ModelRunner.from_bytes(
            bytes(tampered),
            sha256=artifacts[1].sha256,
            model="fraud",
            version="v1",
            row_shape=(FEATURES,),
        )
    with pytest.raises(ArtifactMismatch, match="bytes, registry says"):
        verify_artifact(artifacts[1].data, artifacts[1].sha256, size_bytes=1)


def test_runner_scores_match_torchscript_on_the_whole_batch(
    artifacts: dict[int, Artifact], reference: dict[int, torch.jit.ScriptModule]
) -> None:
    runner = load(artifacts[1], output_row_shape=(1,))
    assert runner.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    batch = rows(5)
    with torch.inference_mode():
        expected = reference[1](torch.from_numpy(batch.copy())).numpy()
    np.testing.assert_allclose(array_of(runner.run(batch)), expected, rtol=1e-5, atol=1e-6)


def test_read_only_rows_are_accepted(artifacts: dict[int, Artifact]) -> None:
    runner = load(artifacts[1])
    view = np.frombuffer(rows(2).tobytes(), dtype="<f4").reshape(2, FEATURES)
    assert not view.flags.writeable
    assert array_of(runner.run(view)).shape == (2, 1)


def test_warm_up_times_each_size_and_counts_injected_latency_without_sleeping(
    artifacts: dict[int, Artifact],
) -> None:
    slept: list[float] = []
    runner = load(artifacts[1], inject_latency_ms=100, max_batch_size=8, sleep=slept.append)
    timings = runner.warm_up([1, 8, 4, 1])
    assert slept == []  # 3 runs x 3 sizes would have slept 0.9 s
    assert sorted(timings) == [1, 4, 8]
    assert all(seconds >= 0.1 for seconds in timings.values())  # yet it is counted
    assert array_of(runner.run(rows(1))).shape == (1, 1)
    assert slept == [0.1]  # serving does sleep: it is a drill knob


def test_model_whose_output_does_not_fit_the_signature_fails_warm_up(
    artifacts: dict[int, Artifact],
) -> None:
    runner = load(artifacts[1], output_row_shape=(2,))
    with pytest.raises(ValueError, match=r"model output rows are \[1\], expected \[2\]"):
        runner.warm_up([1])
