"""Hostile torch.export archives, made from a real one: each hides code in one part torch reads.

Every payload only creates a marker file (`Path.touch` through pickle, `open` in code), so a
test can tell whether it ran.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Json = dict[str, Any]


class Touch:
    """Unpickling this creates `path`: what any pickled object could do instead."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def pickled(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def rewrite(
    data: bytes,
    *,
    model_json: Callable[[Json], None] | None = None,
    weights_config: Callable[[Json], None] | None = None,
    replace: dict[str, bytes] | None = None,
    add: dict[str, bytes] | None = None,
    compression: int = zipfile.ZIP_STORED,
) -> bytes:
    """`data` with its parts edited; paths are under the archive's top folder."""
    source = zipfile.ZipFile(io.BytesIO(data))
    top = source.namelist()[0].split("/")[0]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as target:
        for info in source.infolist():
            path = info.filename.partition("/")[2]
            content = source.read(info.filename)
            if path == "models/model.json" and model_json is not None:
                program = json.loads(content)
                model_json(program)
                content = json.dumps(program).encode()
            if path == "data/weights/model_weights_config.json" and weights_config is not None:
                config = json.loads(content)
                weights_config(config)
                content = json.dumps(config).encode()
            if replace and path in replace:
                content = replace[path]
            target.writestr(info.filename, content)
        for path, content in (add or {}).items():
            target.writestr(f"{top}/{path}", content)
    return out.getvalue()


def with_pickled_weight(data: bytes, marker: Path) -> bytes:
    """A bias stored as a pickle (`use_pickle: true`) that touches `marker` when loaded."""

    def edit(config: Json) -> None:
        entry = config["config"]["bias"]
        entry["use_pickle"] = True
        entry["path_name"] = "weight_pickled"

    return rewrite(
        data, weights_config=edit, add={"data/weights/weight_pickled": pickled(Touch(marker))}
    )


def with_pickled_sample_inputs(data: bytes, marker: Path) -> bytes:
    """Sample inputs that fail weights_only=True, so torch retries with weights_only=False."""
    return rewrite(data, replace={"data/sample_inputs/model.pt": pickled(Touch(marker))})


def with_code_in_a_shape(data: bytes, marker: Path) -> bytes:
    """A symbolic batch dim whose expression string opens a file when sympify evals it."""
    payload = f"(lambda: 0).__globals__['__builtins__']['open']('{marker}', 'w').close()"

    def edit(program: Json) -> None:
        sizes = program["graph_module"]["graph"]["tensor_values"]["features"]["sizes"]
        expr = sizes[0]["as_expr"]
        expr["expr_str"] = f"{payload} or {expr['expr_str']}"

    return rewrite(data, model_json=edit)


def with_code_in_a_guard(data: bytes, marker: Path) -> bytes:
    """A guard, which ep.module() pastes into Python source and execs, that opens a file."""

    def edit(program: Json) -> None:
        program["guards_code"].append(f"open('{marker}', 'w').close() is None")

    return rewrite(data, model_json=edit)


def with_code_in_an_argument_name(data: bytes, marker: Path) -> bytes:
    """A forward argument name carrying code into the generated forward()."""

    def edit(program: Json) -> None:
        signature = program["graph_module"]["module_call_graph"][0]["signature"]
        signature["forward_arg_names"][1] = f"category=open('{marker}', 'w')"

    return rewrite(data, model_json=edit)


def with_a_node_calling(data: bytes, target: str, argument: str) -> bytes:
    """A first graph node calling `target` (resolved from its dotted name) on `argument`."""

    def edit(program: Json) -> None:
        program["graph_module"]["graph"]["nodes"].insert(
            0,
            {
                "target": target,
                "inputs": [{"name": "a", "arg": {"as_string": argument}, "kind": 1}],
                "outputs": [{"as_none": True}],
                "metadata": {},
                "is_hop_single_tensor_return": None,
                "name": "injected",
            },
        )

    return rewrite(data, model_json=edit)
