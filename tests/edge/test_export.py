"""`models export`'s library against a real registry on loopback: the demo model
(TorchScript) and the wine example (torch.export) exported to ONNX, run in onnxruntime on
held-out rows and compared with the model server's answer (its registry loader and runner);
.pt2 exports; and an export that does not answer within the tolerance is not written."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from servemesh.edge.export import (
    ExportRefused,
    export_version,
    manifest_path,
    reference_rows,
    run_onnx,
    write_export,
)
from servemesh.registry.client import fetch_verified
from servemesh.services.model.artifacts import open_artifact
from servemesh.services.model.batching.rows import NamedRows
from servemesh.services.model.loader import registry_loader
from servemesh.spec import MeshSpec
from tests.edge.conftest import EdgeRegistry, Wine
from tests.sandbox.spy import sandbox_spy

pytest.importorskip("onnxruntime", reason="the edge extra: pip install -e '.[edge]'")


async def server_answer(registry: EdgeRegistry, model: str, version: str, rows: Any) -> Any:
    """What a model server answers: its own loader pulls the version from the registry."""
    loaded = await registry_loader(registry.channel, MeshSpec(models={}))(model, version)
    try:
        return await asyncio.to_thread(loaded.runner.run, rows)
    finally:
        await loaded.close()


async def test_the_demo_model_exports_to_onnx_that_answers_as_the_model_server(
    edge_registry: EdgeRegistry, tmp_path: Path
) -> None:
    record, data = await fetch_verified(edge_registry.channel, "fraud", "production")
    exported = await asyncio.to_thread(export_version, data, record, "onnx")
    target = tmp_path / "fraud-v1.onnx"
    manifest = json.loads(write_export(exported, target).read_text())

    assert manifest["format"] == "onnx" and manifest["file"] == "fraud-v1.onnx"
    assert manifest["sha256"] == hashlib.sha256(target.read_bytes()).hexdigest()
    assert manifest["source"] == {
        "model": "fraud",
        "version": "v1",
        "sha256": record.sha256,
        "format": "torchscript",
    }
    assert manifest["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 64]}]
    assert manifest["outputs"] == [{"name": "score", "datatype": "FP32", "shape": [-1, 1]}]
    check = manifest["check"]
    assert (check["atol"], check["rtol"], check["rows"], check["passed"]) == (1e-4, 1e-3, 66, True)
    assert "onnxruntime" in check["runtime"]

    # Rows the export's check never saw, in the device runtime and in the model server.
    rows = np.random.default_rng(7).uniform(-3, 3, size=(200, 64)).astype(np.float32)
    [on_device] = run_onnx(target.read_bytes(), {"features": rows})
    served = await server_answer(edge_registry, "fraud", "v1", rows)
    diff = float(np.abs(on_device - served).max())
    print(f"fraud v1 onnx vs model server, 200 rows: max |diff| {diff:.3g}")
    np.testing.assert_allclose(on_device, served, atol=1e-4, rtol=1e-3)


async def test_the_wine_model_exports_to_onnx_and_answers_its_held_out_lots(
    edge_registry: EdgeRegistry, wine: Wine, tmp_path: Path
) -> None:
    record, data = await fetch_verified(edge_registry.channel, "wine", "v1")
    held = {"chemistry": wine.chemistry, "tasting": wine.tasting}
    exported = await asyncio.to_thread(export_version, data, record, "onnx", rows=held)
    assert exported.rows == len(wine.labels) == 45
    target = tmp_path / "wine.onnx"
    write_export(exported, target)
    manifest = json.loads(manifest_path(target).read_text())
    assert [o["datatype"] for o in manifest["outputs"]] == ["FP32", "INT64"]

    probs, labels = run_onnx(target.read_bytes(), held)
    served = await server_answer(edge_registry, "wine", "v1", NamedRows(held))
    assert isinstance(served, NamedRows)
    diff = float(np.abs(probs - served["class_probs"]).max())
    print(f"wine v1 onnx vs model server, 45 held-out lots: max |diff| {diff:.3g}")
    np.testing.assert_allclose(probs, served["class_probs"], atol=1e-4, rtol=1e-3)
    assert labels.dtype == np.int64
    np.testing.assert_array_equal(labels, served["label"])
    assert (labels == wine.labels).mean() >= 0.9  # the example's held-out accuracy


async def test_pt2_is_the_stored_program_or_a_checked_conversion_of_torchscript(
    edge_registry: EdgeRegistry, tmp_path: Path
) -> None:
    record, data = await fetch_verified(edge_registry.channel, "wine", "v1")
    exported = await asyncio.to_thread(export_version, data, record, "pt2")
    assert exported.data == data and exported.sha256 == record.sha256

    record, data = await fetch_verified(edge_registry.channel, "fraud", "v2")
    exported = await asyncio.to_thread(export_version, data, record, "pt2")
    assert "converted from TorchScript" in exported.note
    opened = open_artifact(exported.data)  # the model server's own allowlist and loader
    assert opened.format == "torch_export"
    assert opened.signature is not None and opened.signature.inputs[0].shape == (-1, 64)
    rows = reference_rows(opened.signature, rows=16, seed=3)["features_1"]
    served = await server_answer(edge_registry, "fraud", "v2", rows)
    with torch.no_grad():
        converted = opened.module(torch.from_numpy(rows)).numpy()
    np.testing.assert_allclose(converted, served, atol=1e-6, rtol=1e-5)


async def test_an_export_outside_the_tolerance_is_refused_and_nothing_is_written(
    edge_registry: EdgeRegistry, tmp_path: Path
) -> None:
    """onnxruntime's float arithmetic is not torch's to the last bit: with no tolerance at
    all, the demo's ONNX export differs, and is refused with its largest difference."""
    record, data = await fetch_verified(edge_registry.channel, "fraud", "v1")
    target = tmp_path / "strict.onnx"
    with pytest.raises(ExportRefused) as refused:
        await asyncio.to_thread(
            export_version, data, record, "onnx", atol=0.0, rtol=0.0, target=str(target)
        )
    message = str(refused.value)
    print(message)
    assert message.startswith(f"{target}: not written: output 'score' differs from the original")
    assert "on 66 reference rows (allowed: atol 0 + rtol 0" in message
    assert not target.exists() and not manifest_path(target).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["registry"]  # the registry's own


async def test_the_export_and_its_check_run_in_a_sandboxed_child(
    edge_registry: EdgeRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    record, data = await fetch_verified(edge_registry.channel, "fraud", "v1")
    spy = sandbox_spy(monkeypatch)  # loading (or tracing) a model in this process now raises
    exported = await asyncio.to_thread(export_version, data, record, "onnx")
    assert [o.entry for o in spy.opened] == [("-m", "servemesh.edge.child")]
    assert spy.opened[0].seccomp == "2"
    monkeypatch.undo()
    # The bytes that came back answer as the original, in onnxruntime here.
    rows = np.random.default_rng(5).standard_normal((32, 64)).astype(np.float32)
    [on_device] = run_onnx(exported.data, {"features": rows})
    served = await server_answer(edge_registry, "fraud", "v1", rows)
    np.testing.assert_allclose(on_device, served, atol=1e-4, rtol=1e-3)
