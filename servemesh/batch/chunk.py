"""One chunk's way from stored rows to model inputs, the same for every engine: the rows
the view does not hold are left out (or get the view's defaults), `--where` drops the rows
it does not keep, and what is left becomes one float32 matrix per model input.

In-process runs call it in the command's process; `--engine dask` calls it on the workers
(`dask_engine`), so both score exactly the same rows the same way.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from servemesh.batch.scorer import ViewInput
from servemesh.batch.source import PinnedView
from servemesh.batch.where import Where
from servemesh.services.feature.store import Rows


@dataclass(frozen=True)
class ChunkPlan:
    """What scoring any chunk of a run needs besides its ids and rows (plain data: it is
    sent to the workers of a distributed run)."""

    pinned: dict[str, PinnedView]
    source_view: str  # the view --where reads
    inputs: tuple[ViewInput, ...]
    # Per view, the row an entity it does not hold gets; None: such entities are left out.
    defaults: dict[str, np.ndarray] | None
    where: Where | None


@dataclass(frozen=True)
class Selected:
    """The rows of a chunk that are scored, as the model's input matrices."""

    kept: list[str]
    matrices: dict[str, np.ndarray]
    missing: int  # ids no view row was found for (left out)
    filtered: int  # ids --where left out


@dataclass(frozen=True)
class ScoredChunk:
    """A chunk's answer: the ids scored, in chunk order, and every output for them."""

    kept: list[str]
    outputs: dict[str, np.ndarray]
    missing: int
    filtered: int


# (first chunk, chunks) -> each chunk from the first on, scored, in chunk order.
ScoredChunks = Callable[[int, int], AsyncGenerator[tuple[int, ScoredChunk]]]


def select_chunk(plan: ChunkPlan, chunk: Sequence[str], rows: Mapping[str, Rows]) -> Selected:
    """The model inputs of the ids of `chunk` that are scored, from their `rows` by view."""
    present = np.ones(len(chunk), dtype=bool)
    values = {}
    for view, found in rows.items():
        matrix = found.values
        if not found.present.all():
            if plan.defaults is not None:
                matrix = matrix.copy()
                matrix[~found.present] = plan.defaults[view]
            else:
                present &= found.present
        values[view] = matrix
    keep = present.copy()
    missing = int((~present).sum())
    filtered = 0
    if plan.where is not None:
        source = plan.pinned[plan.source_view]
        columns = {
            name: values[plan.source_view][:, i]
            for name, i in zip(
                plan.where.features, source.version.positions(plan.where.features), strict=True
            )
        }
        passed = plan.where.mask(rows[plan.source_view].event_ms, columns)
        filtered = int((present & ~passed).sum())
        keep &= passed
    kept = [entity for entity, k in zip(chunk, keep, strict=True) if k]
    matrices: dict[str, np.ndarray] = {}
    if kept:
        for view_input in plan.inputs:
            positions = plan.pinned[view_input.view].version.positions(view_input.features)
            matrices[view_input.name] = np.ascontiguousarray(
                values[view_input.view][keep][:, positions], dtype=np.float32
            )
    return Selected(kept, matrices, missing, filtered)
