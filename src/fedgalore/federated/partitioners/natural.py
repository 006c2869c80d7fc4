"""``natural``: one client per distinct value of a column (a site, a user, a store).

Real federations are split by who holds the data, not by a draw: ``federation.partition.kind:
natural`` with ``column: site`` makes one client per distinct value of the task's ``site`` column
(:meth:`fedgalore.tasks.base.Task.partition_values`). The number of clients is the number of
distinct values; the clients are ordered by sorted value and named by it.

Semantics and order are flwr-datasets' ``NaturalIdPartitioner`` (partition ``i`` holds the rows
whose value is the ``i``-th of the sorted distinct values, in data-set order); tested equal.
"""
from __future__ import annotations

import numpy as np

from fedgalore.federated.partitioners.base import PartitionError, Partitioner, as_values, categories, register

__all__ = ["NaturalPartitioner", "natural_partition"]


def _missing(values: np.ndarray) -> np.ndarray:
    """Mask of missing entries: None, NaN and empty strings."""
    if values.dtype.kind == "f":
        return np.isnan(values)
    if values.dtype.kind in "OUS":
        return np.array([v is None or (isinstance(v, float) and v != v) or (isinstance(v, (str, bytes)) and not v.strip())
                         for v in values.tolist()], dtype=bool)
    return np.zeros(values.shape, dtype=bool)


def natural_partition(values: np.ndarray, column: str = "column") -> tuple[list[np.ndarray], list]:
    """``(parts, ids)``: ``parts[i] = {j : values_j = ids[i]}`` (ascending), ``ids`` the sorted
    distinct values. A missing value (None, NaN, empty) is a :class:`PartitionError` that counts
    the rows, as is a column with a single value (one client is no federation)."""
    arr = as_values(values)
    missing = _missing(arr)
    if missing.any():
        rows = np.flatnonzero(missing)
        raise PartitionError(
            f"federation.partition.column={column!r} is missing in {rows.size} of {arr.size} training rows "
            f"(e.g. row {', '.join(map(str, rows[:3]))}); every row needs a client: fill the column or drop those rows"
        )
    ids, codes = categories(arr)
    if ids.size == 1:
        raise PartitionError(
            f"federation.partition.column={column!r} has a single value ({ids.tolist()[0]!r}) in all {arr.size} training "
            "rows, so a natural partition is one client; partition by a column with several values, or split "
            "the data with kind: iid / dirichlet / quantity and federation.num_clients"
        )
    order = np.argsort(codes, kind="stable").astype(np.int64)
    parts = np.split(order, np.cumsum(np.bincount(codes))[:-1])
    return [p.copy() for p in parts], ids.tolist()


@register
class NaturalPartitioner(Partitioner):
    """:func:`natural_partition` over ``column``; ``federation.num_clients`` is inferred (a given
    value that differs from the number of distinct values is an error)."""

    kind = "natural"
    fields = ("column",)
    seeded = False
    example = "natural:site"
    infers_clients = True

    def column(self) -> str | None:
        return self.cfg.column

    @classmethod
    def parse_setting(cls, param: str) -> dict:
        if not param:
            raise PartitionError(f"partition setting 'natural' needs the column, e.g. {cls.example}")
        return {"column": param}  # a column name, even when it looks like a number

    def split(self, values: np.ndarray, num_partitions: int | None, seed: int) -> list[np.ndarray]:
        parts, ids = natural_partition(values, self.cfg.column)
        if num_partitions is not None and num_partitions != len(parts):
            shown = ", ".join(map(str, ids[:5])) + (", ..." if len(ids) > 5 else "")
            raise PartitionError(
                f"federation.num_clients={num_partitions}, but column {self.cfg.column!r} has {len(parts)} distinct "
                f"values ({shown}): a natural partition has one client per value; leave federation.num_clients "
                f"out (or null), or set it to {len(parts)}"
            )
        return parts

    def names(self, values: np.ndarray) -> list[str] | None:
        return [str(v) for v in categories(as_values(values))[0].tolist()]
