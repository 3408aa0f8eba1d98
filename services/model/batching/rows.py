"""What the batcher batches: rows, as one array or as named arrays that share the batch dim.

A model with one input and one output travels as a plain `np.ndarray` (rows first), as it
always has: the demo path pays nothing for multi-tensor models. A model with several named
inputs or outputs travels as `NamedRows`, every tensor with the same number of rows. The
batcher itself only counts rows, joins requests into a batch and cuts the answer back into
per-request parts (`row_count`, `join_rows`, `cut_rows`); which tensors a row holds is the
signature's business (`tensors`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Union

import numpy as np

__all__ = ["NamedRows", "Rows", "cut_rows", "join_rows", "row_count"]


class NamedRows(Mapping[str, np.ndarray]):
    """Named tensors that share their first (batch) dim: one request's rows, or a batch's.

    Immutable; the order of names is the order they were given in (the signature's).
    """

    __slots__ = ("_tensors", "n_rows")

    def __init__(self, tensors: Mapping[str, np.ndarray]) -> None:
        if not tensors:
            raise ValueError("NamedRows needs at least one tensor")
        counts = {name: (int(t.shape[0]) if t.ndim else -1) for name, t in tensors.items()}
        first = next(iter(counts.values()))
        if first < 0 or any(count != first for count in counts.values()):
            raise ValueError(f"tensors do not share a batch dim: rows per tensor {counts}")
        self._tensors = dict(tensors)
        self.n_rows = first

    def __getitem__(self, name: str) -> np.ndarray:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        shapes = {name: list(t.shape) for name, t in self._tensors.items()}
        return f"NamedRows({shapes})"


# One request's rows or a batch's: a plain array for one-tensor models, else NamedRows.
Rows = Union[np.ndarray, NamedRows]


def row_count(rows: Rows) -> int:
    """The number of rows (the batch dim's size); -1 for a scalar array (not rows at all)."""
    if isinstance(rows, NamedRows):
        return rows.n_rows
    return int(rows.shape[0]) if rows.ndim else -1


def join_rows(parts: Sequence[Rows]) -> Rows:
    """The parts' rows one after another: a batch. All parts must be of one kind."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, NamedRows):
        named = [part for part in parts if isinstance(part, NamedRows)]
        if len(named) != len(parts):
            raise TypeError("cannot join NamedRows with plain arrays")
        return NamedRows({name: np.concatenate([part[name] for part in named]) for name in first})
    arrays = [part for part in parts if isinstance(part, np.ndarray)]
    if len(arrays) != len(parts):
        raise TypeError("cannot join plain arrays with NamedRows")
    return np.concatenate(arrays)


def cut_rows(rows: Rows, start: int, stop: int) -> Rows:
    """Rows start..stop (a view, no copy)."""
    if isinstance(rows, NamedRows):
        return NamedRows({name: tensor[start:stop] for name, tensor in rows.items()})
    return rows[start:stop]
