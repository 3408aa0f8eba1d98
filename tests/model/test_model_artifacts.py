"""Artifacts: format detection, torch.export signatures, and archives that hide code.

The hostile archives are real exported programs with one part rewritten
(tests/model/crafted_pt2.py); each payload would create a marker file if it ran.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from servemesh.services.model.artifacts import (
    ArtifactError,
    detect_format,
    open_artifact,
)
from servemesh.services.model.batching import NamedRows
from servemesh.services.model.errors import LoadError
from servemesh.services.model.loader import load_model
from servemesh.services.model.runner import ArtifactMismatch, ModelRunner
from servemesh.services.model.tensors import Signature, TensorSig
from servemesh.spec import BatchingSpec
from tests.model import crafted_pt2
from tests.model.torch_models import (
    CHURN_FEATURES,
    CHURN_SIGNATURE,
    Churn,
    churn_example,
    churn_reference,
    exported,
    scripted,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def churn() -> Churn:
    return Churn(seed=5)


@pytest.fixture(scope="module")
def churn_pt2(churn: Churn) -> bytes:
    return exported(churn, churn_example())


# --- formats -----------------------------------------------------------------------------


def test_formats_are_told_apart_and_everything_else_is_refused(
    churn: Churn, churn_pt2: bytes
) -> None:
    assert detect_format(churn_pt2) == "torch_export"
    assert detect_format(scripted(churn)) == "torchscript"
    checkpoint = io.BytesIO()
    torch.save(churn.state_dict(), checkpoint)
    cases = {
        checkpoint.getvalue(): "a pickled torch.save checkpoint, not a model program",
        b"name,score\nuser-1,0.5\n": "not a model: neither a TorchScript (.pt) nor",
        churn_pt2[: len(churn_pt2) // 2]: "truncated or damaged archive",
        # Cut inside the directory: zipfile alone would open the archive nested in it.
        churn_pt2[:-200]: "truncated or damaged archive: it does not end with its directory",
    }
    for data, message in cases.items():
        with pytest.raises(ArtifactError, match=message.replace("(", r"\(").replace(")", r"\)")):
            detect_format(data)


def test_an_exported_program_records_its_signature(churn_pt2: bytes) -> None:
    opened = open_artifact(churn_pt2)
    assert opened.format == "torch_export"
    assert opened.signature == Signature(
        inputs=CHURN_SIGNATURE.inputs,
        outputs=[TensorSig("output_0", "FP32", (-1, 3)), TensorSig("output_1", "INT64", (-1,))],
    )


class Named(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"probabilities": x.softmax(-1), "label": x.argmax(-1)}


def test_a_program_returning_a_dict_names_its_outputs_by_key() -> None:
    data = exported(Named(), (torch.ones(2, 3),))
    signature = open_artifact(data).signature
    assert signature is not None
    assert [(t.name, t.datatype, t.shape) for t in signature.outputs] == [
        ("probabilities", "FP32", (-1, 3)),
        ("label", "INT64", (-1,)),
    ]


def test_a_program_without_a_batch_dim_is_refused_with_the_fix() -> None:
    program = torch.export.export(torch.nn.Linear(3, 2).eval(), (torch.ones(2, 3),))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    with pytest.raises(ArtifactError, match=r"input 'input' has a fixed first dim 2: export it"):
        open_artifact(buffer.getvalue())


def test_an_exported_program_runs_in_the_runner_like_the_module(
    churn: Churn, churn_pt2: bytes
) -> None:
    runner = ModelRunner.from_bytes(
        churn_pt2,
        sha256=hashlib.sha256(churn_pt2).hexdigest(),
        model="churn",
        version="v1",
        format="torch_export",
        signature=Signature(
            inputs=CHURN_SIGNATURE.inputs,
            outputs=[
                TensorSig("output_0", "FP32", (-1, 3)),
                TensorSig("output_1", "INT64", (-1,)),
            ],
        ),
    )
    runner.warm_up([1, 8])
    rng = np.random.default_rng(1)
    features = rng.normal(size=(3, CHURN_FEATURES)).astype(np.float32)
    category = np.array([0, 4, 2], np.int64)
    result = runner.run(NamedRows({"features": features, "category": category}))
    assert isinstance(result, NamedRows)
    probabilities, label = churn_reference(churn, features, category)
    np.testing.assert_allclose(result["output_0"], probabilities, rtol=1e-5)
    np.testing.assert_array_equal(result["output_1"], label)


def test_tampered_bytes_never_reach_torch_export(
    churn_pt2: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.export, "load", lambda *a, **k: pytest.fail("parsed unverified"))
    tampered = bytearray(churn_pt2)
    tampered[len(tampered) // 3] ^= 0x01
    with pytest.raises(ArtifactMismatch):
        ModelRunner.from_bytes(
            bytes(tampered),
            sha256=hashlib.sha256(churn_pt2).hexdigest(),
            model="churn",
            version="v1",
            format="torch_export",
            signature=CHURN_SIGNATURE,
        )


# --- archives that hide code -------------------------------------------------------------

Craft = Callable[[bytes, Path], bytes]

HOSTILE: list[tuple[str, Craft, str]] = [
    ("pickled-weight", crafted_pt2.with_pickled_weight, "stored as a pickle"),
    (
        "pickled-sample-inputs",
        crafted_pt2.with_pickled_sample_inputs,
        "data/sample_inputs/model.pt: the pickle references '__builtin__ getattr'",
    ),
    ("code-in-a-shape", crafted_pt2.with_code_in_a_shape, "expr_str: "),
    ("code-in-a-guard", crafted_pt2.with_code_in_a_guard, "guards_code: "),
    (
        "code-in-an-argument-name",
        crafted_pt2.with_code_in_an_argument_name,
        'forward argument "category=open(',
    ),
    (
        "python-callable-node",
        lambda data, marker: crafted_pt2.with_a_node_calling(
            data, "torch.os.system", f"touch {marker}"
        ),
        "node target 'torch.os.system' is not an ATen operator",
    ),
    (
        "file-writing-aten-op",
        lambda data, marker: crafted_pt2.with_a_node_calling(
            data, "torch.ops.aten.save.default", str(marker)
        ),
        "node target 'torch.ops.aten.save.default' opens files",
    ),
    (
        "compiled-library",
        lambda data, marker: crafted_pt2.rewrite(
            data, add={"data/aotinductor/model/model.so": b"\x7fELF"}
        ),
        "unexpected parts data/aotinductor/model/model.so",
    ),
    (
        "compressed",
        lambda data, marker: crafted_pt2.rewrite(data, compression=zipfile.ZIP_DEFLATED),
        "compressed (torch.export.save stores)",
    ),
]


@pytest.mark.parametrize(
    ("craft", "message"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_hostile_archives_are_refused_before_their_code_can_run(
    churn_pt2: bytes, tmp_path: Path, craft: Craft, message: str
) -> None:
    marker = tmp_path / "ran"
    hostile = craft(churn_pt2, marker)
    with pytest.raises(ArtifactError) as caught:
        open_artifact(hostile)
    assert str(caught.value).startswith("torch.export archive refused: ")
    assert message in str(caught.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    "craft",
    [crafted_pt2.with_pickled_weight, crafted_pt2.with_code_in_a_shape],
    ids=["pickled-weight", "code-in-a-shape"],
)
def test_torch_export_load_alone_runs_the_hidden_code(
    churn_pt2: bytes, tmp_path: Path, craft: Craft
) -> None:
    """Why the guard exists: torch 2.13's own loader runs these payloads while loading."""
    marker = tmp_path / "ran"
    try:
        torch.export.load(io.BytesIO(craft(churn_pt2, marker)))
    except Exception:  # what fails after the payload ran is torch's business
        pass
    assert marker.exists()


def test_torch_export_guards_run_as_python_on_every_call(churn_pt2: bytes, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    program = torch.export.load(io.BytesIO(crafted_pt2.with_code_in_a_guard(churn_pt2, marker)))
    module = program.module()
    assert not marker.exists()  # exec'd into a function when the module is built ...
    module(*churn_example())
    assert marker.exists()  # ... whose body runs with every forward pass


# --- loading for serving -----------------------------------------------------------------


async def test_an_exported_program_loads_for_serving_under_its_platform(churn_pt2: bytes) -> None:
    loaded = await load_model(
        churn_pt2,
        model="churn",
        version="v1",
        sha256=hashlib.sha256(churn_pt2).hexdigest(),
        signature=CHURN_SIGNATURE,
        format="torch_export",
        batching=BatchingSpec(max_batch_size=4),
    )
    try:
        assert loaded.platform == "pytorch_torch_export"
        assert sorted(loaded.batcher.latency.snapshot()) == [1, 4]
    finally:
        await loaded.close()


async def test_a_program_that_breaks_its_declared_signature_fails_to_load(
    churn_pt2: bytes,
) -> None:
    wrong = Signature(
        inputs=CHURN_SIGNATURE.inputs,
        outputs=[TensorSig("probabilities", "FP32", (-1, 3)), TensorSig("label", "INT32", (-1,))],
    )
    with pytest.raises(LoadError) as caught:
        await load_model(
            churn_pt2,
            model="churn",
            version="v1",
            sha256=hashlib.sha256(churn_pt2).hexdigest(),
            signature=wrong,
            format="torch_export",
        )
    assert caught.value.message == (
        "model 'churn' version 'v1': warm-up: model output 'label' is INT64, "
        "the signature says INT32"
    )


async def test_a_hostile_archive_fails_to_load_naming_why(churn_pt2: bytes, tmp_path: Path) -> None:
    hostile = crafted_pt2.with_pickled_weight(churn_pt2, tmp_path / "ran")
    with pytest.raises(ArtifactError, match="stored as a pickle"):
        await load_model(
            hostile,
            model="churn",
            version="v1",
            sha256=hashlib.sha256(hostile).hexdigest(),
            signature=CHURN_SIGNATURE,
            format="torch_export",
        )
    assert not (tmp_path / "ran").exists()
