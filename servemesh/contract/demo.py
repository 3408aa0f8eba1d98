"""The demo "fraud score" model and features that `servemesh up` seeds the mesh with.

The spec's defaults name this content (`demo:<seed>` versions over the `f00`..`f63`
features), so the spec module imports the names below; torch is imported only where a
model is built, which keeps loading a spec light.
"""

from __future__ import annotations

import hashlib
import io
import re
import zipfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

N_FEATURES = 64
HIDDEN = 512
# The compute-bound benchmark model: the same network four times as wide, so one forward
# pass costs real compute (~1 ms per batch of 16 on one core) and batching, not the
# protocol, decides throughput.
HEAVY_HIDDEN = 2048
DEMO_FEATURES = [f"f{i:02d}" for i in range(N_FEATURES)]
# A model version whose `source` is "demo:<seed>" is built from the demo MLP with that seed;
# "demo-heavy:<seed>" from the heavy MLP, exported with torch.export.
DEMO_SOURCE_PREFIX = "demo:"
HEAVY_SOURCE_PREFIX = "demo-heavy:"


def _seed_after(source: str, prefix: str) -> int | None:
    if not source.startswith(prefix):
        return None
    seed = source.removeprefix(prefix)
    if not seed.isdigit():
        raise ValueError(f"source: {source!r} is not {prefix}<seed> with a decimal seed")
    return int(seed)


def demo_seed(source: str) -> int | None:
    """The seed a `demo:<seed>` source names; None for any other source."""
    return _seed_after(source, DEMO_SOURCE_PREFIX)


def heavy_seed(source: str) -> int | None:
    """The seed a `demo-heavy:<seed>` source names; None for any other source."""
    return _seed_after(source, HEAVY_SOURCE_PREFIX)


def source_artifact(source: str) -> Artifact | None:
    """The artifact a built-in source names (`demo:<seed>`, `demo-heavy:<seed>`); None
    for a version that must already be in the registry."""
    seed = demo_seed(source)
    if seed is not None:
        return demo_artifact(seed)
    seed = heavy_seed(source)
    if seed is not None:
        return heavy_artifact(seed)
    return None


@dataclass(frozen=True)
class Artifact:
    data: bytes
    sha256: str
    format: str = "torchscript"  # or torch_export: what the registry records at push

    @property
    def size(self) -> int:
        return len(self.data)


def build_fraud_model(seed: int) -> torch.nn.Module:
    """MLP 64 -> 512 -> 512 -> 1 with a sigmoid: the same weights for the same seed."""
    from servemesh.contract.demo_model import fraud_mlp

    return fraud_mlp(seed, N_FEATURES, HIDDEN)


def torchscript_artifact(model: torch.nn.Module) -> Artifact:
    """Script the model and serialise it: TorchScript loads without unpickling Python code.

    The same model gives the same bytes in any process and any checkout (see
    `canonical_torchscript`), so a re-run of `servemesh up` meets its own earlier upload.
    """
    import torch

    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(model), buffer)
    data = canonical_torchscript(buffer.getvalue())
    return Artifact(data=data, sha256=hashlib.sha256(data).hexdigest())


# A TorchScript class attribute declared Final: `  name : Final[int] = 64`.
_FINAL_ATTRIBUTE = re.compile(r"^  \w+ : Final\[.*\]( = .*)?$")
_SERIALIZATION_ID = "/.data/serialization_id"


def canonical_torchscript(data: bytes) -> bytes:
    """The same TorchScript archive with everything that varies between exports fixed.

    `torch.jit.save` output differs run to run in three places, none of which changes
    what the program computes: the order of Final attributes in the saved code follows
    Python's string-hash seed; the debug tables (`*.debug_pkl`) carry the absolute path
    of the installed torch sources; and every archive gets a random serialization id.
    Here the Final attributes are sorted, the optional debug tables dropped, the id
    derived from the content, and the zip rewritten with fixed timestamps.

    A fourth depends on the process: a class scripted when one of its name was scripted
    before in the same process is saved as `<module>.___torch_mangle_<n>.<class>`. Where
    the plain name is free in the archive, the mangling is taken back out (`_unmangle`).
    """
    entries: list[tuple[str, bytes]] = []
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            name = info.filename
            if name.endswith(".debug_pkl") or name.endswith(_SERIALIZATION_ID):
                continue
            content = archive.read(name)
            if name.endswith(".py") and "/code/" in name:
                content = _sort_final_attributes(content.decode()).encode()
            entries.append((name, content))
        id_name = next(
            (i.filename for i in archive.infolist() if i.filename.endswith(_SERIALIZATION_ID)),
            None,
        )
    entries = _unmangle(entries)
    digest = hashlib.sha256()
    for name, content in entries:
        digest.update(name.encode() + b"\0" + content)
    if id_name is not None:
        # torch writes a 40-digit decimal id; keep that shape.
        entries.append((id_name, str(int(digest.hexdigest(), 16))[:40].encode()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, content in entries:
            archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), content)
    return out.getvalue()


_MANGLED = re.compile(rb"(__torch__(?:\.\w+)*?)\.___torch_mangle_\d+")


def _unmangle(entries: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """The entries with `.___torch_mangle_<n>` taken out of module names, where that is
    safe: each mangled module's plain name is not in the archive already (no two classes
    would share a name), and in pickles the names occur only as class references (GLOBAL,
    newline-terminated: no length field to fix up). Otherwise the entries come back as
    they were."""
    import pickletools

    mangled = {m.group(0) for _, content in entries for m in _MANGLED.finditer(content)}
    if not mangled:
        return entries
    plain = {name: _MANGLED.sub(rb"\1", name) for name in mangled}
    if len(set(plain.values())) != len(plain):
        return entries
    paths = {path for path, _ in entries}
    for target in plain.values():
        module_path = target.decode().replace(".", "/")
        if any(p.endswith(f"/code/{module_path}.py") for p in paths):
            return entries
    fixed: list[tuple[str, bytes]] = []
    for path, content in entries:
        if path.endswith(".pkl") and _MANGLED.search(content):
            in_globals = sum(
                len(_MANGLED.findall(str(arg).encode()))
                for op, arg, _ in pickletools.genops(content)
                if op.name == "GLOBAL"
            )
            if in_globals != len(_MANGLED.findall(content)):
                return entries
        path = _MANGLED.sub(rb"\1", path.encode()).decode()
        # A mangled module's code file is `<module>/___torch_mangle_<n>.py`.
        path = re.sub(r"/___torch_mangle_\d+\.py$", ".py", path)
        fixed.append((path, _MANGLED.sub(rb"\1", content)))
    return fixed


def _sort_final_attributes(code: str) -> str:
    """Sort each run of consecutive Final attribute lines (their order carries no meaning)."""
    lines: list[str] = []
    run: list[str] = []
    for line in code.split("\n"):
        if _FINAL_ATTRIBUTE.match(line):
            run.append(line)
            continue
        lines += sorted(run)
        run = []
        lines.append(line)
    lines += sorted(run)
    return "\n".join(lines)


def demo_artifact(seed: int) -> Artifact:
    return torchscript_artifact(build_fraud_model(seed))


def build_heavy_model(seed: int) -> torch.nn.Module:
    """MLP 64 -> 2048 -> 2048 -> 1 with a sigmoid (4.3 M multiply-adds a row)."""
    from servemesh.contract.demo_model import fraud_mlp

    return fraud_mlp(seed, N_FEATURES, HEAVY_HIDDEN)


def export_artifact(model: torch.nn.Module, n_features: int = N_FEATURES) -> Artifact:
    """`model` through torch.export, its first dimension (rows) dynamic, as `.pt2` bytes.

    torch.export.save writes the same bytes for the same weights (names, fixed zip times
    and a content-derived id), which a re-run of `servemesh up` relies on; a unit test
    checks it across processes.
    """
    import torch

    rows = torch.export.Dim("rows", min=1, max=1 << 16)
    program = torch.export.export(
        model, (torch.zeros(2, n_features),), dynamic_shapes={"features": {0: rows}}
    )
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    data = buffer.getvalue()
    return Artifact(data=data, sha256=hashlib.sha256(data).hexdigest(), format="torch_export")


def heavy_artifact(seed: int) -> Artifact:
    return export_artifact(build_heavy_model(seed))


def demo_signature(n_features: int = N_FEATURES) -> dict[str, list[dict[str, object]]]:
    """The registry signature of the demo models: `features` FP32 [-1, n] -> `score` FP32 [-1, 1].

    Returned as keyword arguments for `servemesh.registry.client.push_version`.
    """
    return {
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, n_features]}],
        "outputs": [{"name": "score", "datatype": "FP32", "shape": [-1, 1]}],
    }


def demo_entity_id(index: int) -> str:
    return f"user-{index}"


def demo_features(n_entities: int, seed: int = 7) -> dict[str, np.ndarray]:
    """Feature rows (float32, 64 wide) for entities user-0 .. user-(n-1)."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(0.0, 1.0, size=(n_entities, N_FEATURES)).astype(np.float32)
    return {demo_entity_id(i): rows[i] for i in range(n_entities)}
