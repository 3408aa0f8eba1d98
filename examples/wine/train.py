"""Train the wine classifier and write what the mesh needs to serve it.

    python -m examples.wine.train --out wine-out        (or python examples/wine/train.py)

Data: scikit-learn's bundled wine dataset (178 wines from three cultivars, 13 measurements
each; no download). Each wine is a *lot* of the cellar, `L-0000` .. `L-0177`. The lab's
chemistry of a lot lives in the online store (feature view `lot`); the three measurements
taken at the tasting are sent raw by the caller with each request. The model answers the
probability of each cultivar and the most likely one.

Writes into --out:

    wine.pt2       torch.export program: inputs chemistry FP32 [-1, 10], tasting FP32 [-1, 3];
                   outputs class_probs FP32 [-1, 3], label INT64 [-1]
    lots.parquet   lot_id, event_ts, and the view's ten chemistry columns, one row per lot
    mesh.yaml      the view and the model, for `servemesh apply`

Training is seeded and runs on the CPU in a few seconds; the same run gives the same
accuracy and the same wine.pt2 bytes (and, with --as-of, the same lots.parquet bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from sklearn.datasets import load_wine
from sklearn.model_selection import train_test_split
from torch import nn

MODEL = "wine"
VIEW = "lot"
KEY = "lot_id"
TIMESTAMP = "event_ts"
# The lab's measurements of a lot: stored in the view, read by the gateway.
CHEMISTRY = [
    "alcohol",
    "malic_acid",
    "ash",
    "alcalinity_of_ash",
    "magnesium",
    "total_phenols",
    "flavanoids",
    "nonflavanoid_phenols",
    "proanthocyanins",
    "proline",
]
# Measured at the tasting, on the glass: the caller sends them with the request.
TASTING = ["color_intensity", "hue", "od280_od315"]
CLASSES = 3
SEED = 0
# Requests larger than the Dim's max fail the program's own guard: keep it at least the
# model's max_rows_per_request and max_batch_size (1024 and 64 by default).
MAX_BATCH = 4096

# scikit-learn's column names, where they differ from the ones above.
_SKLEARN_NAMES = {"od280_od315": "od280/od315_of_diluted_wines"}


def lot_id(index: int) -> str:
    return f"L-{index:04d}"


class WineNet(nn.Module):
    """Standardise both inputs (the training set's mean and std, kept in the program),
    then a small MLP over the thirteen measurements."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.body = nn.Sequential(
            nn.Linear(len(CHEMISTRY) + len(TASTING), 16), nn.ReLU(), nn.Linear(16, CLASSES)
        )

    def logits(self, chemistry: torch.Tensor, tasting: torch.Tensor) -> torch.Tensor:
        x = (torch.cat([chemistry, tasting], dim=1) - self.mean) / self.std
        out: torch.Tensor = self.body(x)
        return out

    def forward(self, chemistry: torch.Tensor, tasting: torch.Tensor) -> dict[str, torch.Tensor]:
        # A dict: the exported program names its outputs after the keys.
        probs = torch.softmax(self.logits(chemistry, tasting), dim=1)
        return {"class_probs": probs, "label": torch.argmax(probs, dim=1)}


@dataclass(frozen=True)
class Data:
    chemistry: np.ndarray  # float32 [n, 10]
    tasting: np.ndarray  # float32 [n, 3]
    raw: np.ndarray  # float64 [n, 13]: the file's values, CHEMISTRY then TASTING
    labels: np.ndarray  # int64 [n]


def load() -> Data:
    wine = load_wine()
    names = list(wine.feature_names)
    columns = [names.index(_SKLEARN_NAMES.get(f, f)) for f in [*CHEMISTRY, *TASTING]]
    raw = np.asarray(wine.data, dtype=np.float64)[:, columns]
    values = raw.astype(np.float32)
    return Data(
        chemistry=values[:, : len(CHEMISTRY)],
        tasting=values[:, len(CHEMISTRY) :],
        raw=raw,
        labels=np.asarray(wine.target, dtype=np.int64),
    )


@dataclass(frozen=True)
class Trained:
    model: WineNet
    accuracy: float
    correct: int
    held_out: list[int]  # row indices of the held-out lots


def train(data: Data, *, steps: int = 400) -> Trained:
    torch.manual_seed(SEED)
    rows = np.arange(len(data.labels))
    fit, held = train_test_split(rows, test_size=0.25, stratify=data.labels, random_state=SEED)
    fit, held = np.sort(fit), np.sort(held)
    chem, taste = torch.from_numpy(data.chemistry), torch.from_numpy(data.tasting)
    labels = torch.from_numpy(data.labels)
    both = torch.cat([chem, taste], dim=1)[fit]
    model = WineNet(both.mean(dim=0), both.std(dim=0))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02, weight_decay=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(steps):  # full batch: 133 rows
        optimizer.zero_grad()
        loss = loss_fn(model.logits(chem[fit], taste[fit]), labels[fit])
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        predicted = model(chem[held], taste[held])["label"]
    correct = int((predicted == labels[held]).sum())
    return Trained(model, correct / len(held), correct, [int(i) for i in held])


def export(model: WineNet, path: Path) -> None:
    batch = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    example = (torch.zeros(2, len(CHEMISTRY)), torch.zeros(2, len(TASTING)))
    program = torch.export.export(
        model.eval(),
        example,
        dynamic_shapes={"chemistry": {0: batch}, "tasting": {0: batch}},
    )
    # Each node records the Python stack that made it, with the training machine's paths:
    # dropped, so the archive names no local file and its bytes do not depend on where
    # the code was checked out.
    for node in program.graph.nodes:
        node.meta.pop("stack_trace", None)
    torch.export.save(program, str(path))


def write_lots(data: Data, path: Path, as_of: datetime) -> None:
    """One row per lot: its id, when the lab measured it, and the view's columns."""
    n = len(data.labels)
    columns: dict[str, pa.Array] = {
        KEY: pa.array([lot_id(i) for i in range(n)], pa.string()),
        TIMESTAMP: pa.array([as_of] * n, pa.timestamp("s", tz="UTC")),
    }
    for j, name in enumerate(CHEMISTRY):
        columns[name] = pa.array(data.raw[:, j], pa.float64())
    pq.write_table(pa.table(columns), path)


MESH_YAML = """\
# The wine example, added to a running mesh: `servemesh apply mesh.yaml`.
feature_views:
  {view}:
    entity: {view}             # lots are looked up by their lot_id
    features: [{chemistry}]
    max_age: 30d            # a lot measured more than 30 days ago is stale (error)
models:
  {model}:
    inputs:                 # one entry per input tensor of wine.pt2
      chemistry: {{view: {view}, features: [{chemistry}]}}
      tasting: {{raw: true}}  # {tasting}: sent by the caller
    versions: {{v1: {{}}}}      # pushed to the registry first (servemesh models push)
    traffic: {{v1: 100}}
"""


def write_mesh_yaml(path: Path) -> None:
    path.write_text(
        MESH_YAML.format(
            view=VIEW,
            model=MODEL,
            chemistry=", ".join(CHEMISTRY),
            tasting=", ".join(TASTING),
        )
    )


def _as_of(text: str) -> datetime:
    when = datetime.fromisoformat(text)
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", required=True, type=Path, help="folder to write into")
    parser.add_argument(
        "--as-of",
        type=_as_of,
        help="the lots' event time, ISO 8601 (default: now, to the second)",
    )
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    as_of: datetime = args.as_of or datetime.now(UTC).replace(microsecond=0)

    # One thread and deterministic kernels: the same run, the same weights, the same bytes.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    data = load()
    trained = train(data)
    held = len(trained.held_out)
    print(
        f"trained {MODEL}: {len(data.labels) - held} lots, "
        f"held-out accuracy {trained.accuracy:.4f} ({trained.correct} of {held})"
    )

    artifact = out / f"{MODEL}.pt2"
    export(trained.model, artifact)
    digest = hashlib.sha256(artifact.read_bytes()).hexdigest()
    print(f"wrote {artifact}: sha256 {digest}")
    lots = out / "lots.parquet"
    write_lots(data, lots, as_of)
    n = len(data.labels)
    measured = f"{as_of:%Y-%m-%dT%H:%M:%SZ}"
    print(f"wrote {lots}: {n} lots ({lot_id(0)} .. {lot_id(n - 1)}), measured {measured}")
    spec = out / "mesh.yaml"
    write_mesh_yaml(spec)
    print(f"wrote {spec}: view '{VIEW}', model '{MODEL}'")

    # Lots the model never saw in training, one per cultivar, with their tasting notes.
    for cultivar in range(CLASSES):
        row = next(i for i in trained.held_out if data.labels[i] == cultivar)
        tasting = ",".join(f"{v:g}" for v in data.raw[row, len(CHEMISTRY) :])
        print(f"held out: {lot_id(row)} (cultivar {cultivar}), tasting={tasting}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
