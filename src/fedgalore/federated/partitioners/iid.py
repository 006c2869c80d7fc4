"""``iid``: shuffle and cut into near-equal shards (the paper's IID setting, its tables' ✓ columns)."""
from __future__ import annotations

import numpy as np

from fedgalore.federated.partitioners.base import Partitioner, check_clients, check_int, register

__all__ = ["iid_partition", "IIDPartitioner"]


def iid_partition(n: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Shuffle ``range(n)`` and cut it into ``num_clients`` near-equal shards.

    With ``π`` a uniform random permutation of ``{0..n-1}`` and ``M = num_clients``, client
    ``j`` gets ``π[s_j : s_{j+1}]`` where the shard sizes are ``⌈n/M⌉`` for the first
    ``n mod M`` clients and ``⌊n/M⌋`` for the rest (sizes differ by at most one). This is the
    IID setting of the paper's tables (✓ columns). Deterministic given ``seed``.
    """
    n = check_int("n", n, 1)
    m = check_clients(num_clients, n)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n).astype(np.int64)
    return [part.copy() for part in np.array_split(perm, m)]


@register
class IIDPartitioner(Partitioner):
    """:func:`iid_partition` (the values are only counted). flwr-datasets' ``IidPartitioner``
    cuts the data set in its given order (``FederatedDataset`` shuffles it first); the split is
    the same in kind, not in assignment (another shuffle)."""

    kind = "iid"
    example = "iid"

    def split(self, values: np.ndarray, num_partitions: int | None, seed: int) -> list[np.ndarray]:
        return iid_partition(len(values), num_partitions, seed)
