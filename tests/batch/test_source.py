"""Reading a chunk from the online store: more ids than one MGET takes (READ_SLICE) come
back as one set of rows, in the ids' order, every slice checked against the pinned
version; against the session's real Redis."""

from __future__ import annotations

import numpy as np
import pytest

from servemesh.batch.errors import SourceChanged
from servemesh.batch.source import READ_SLICE, pin_view, read_rows
from tests.batch.conftest import StartBatchMesh


async def test_a_read_of_several_slices_is_the_rows_in_order(start_mesh: StartBatchMesh) -> None:
    mesh = await start_mesh()
    n = 2 * READ_SLICE + 5
    loaded = await mesh.load_view(n)
    pinned = await pin_view(mesh.store, "user")
    # Every id, shuffled, with an unknown id inside the second slice.
    order = list(np.random.default_rng(3).permutation(n))
    ids = [loaded["ids"][i] for i in order]
    ids.insert(READ_SLICE + 7, "nobody")
    rows = await read_rows(mesh.redis, pinned, ids)
    assert len(rows.present) == len(rows.values) == len(rows.event_ms) == n + 1
    known = np.ones(n + 1, dtype=bool)
    known[READ_SLICE + 7] = False
    np.testing.assert_array_equal(rows.present, known)
    np.testing.assert_array_equal(rows.values[known], loaded["values"][order])
    np.testing.assert_array_equal(rows.event_ms[known], loaded["event_ms"][order])


async def test_a_multi_slice_read_of_a_replaced_view_fails(start_mesh: StartBatchMesh) -> None:
    mesh = await start_mesh()
    loaded = await mesh.load_view(READ_SLICE + 1)
    pinned = await pin_view(mesh.store, "user")
    await mesh.load_view(READ_SLICE + 1, seed=8)  # a new version: the pinned one is gone
    with pytest.raises(SourceChanged):
        await read_rows(mesh.redis, pinned, loaded["ids"])
