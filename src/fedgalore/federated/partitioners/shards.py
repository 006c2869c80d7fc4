"""``shards``: sort by class, cut into shards, give every client ``shards_per_client`` random shards.

McMahan et al.'s pathological non-IID split ("Communication-Efficient Learning of Deep Networks
from Decentralized Data", 2017): with ``M`` clients and ``s = shards_per_client``, the examples
sorted by class (stably) are cut into ``S = M·s`` consecutive shards, the shards are permuted at
random and client ``j`` gets shards ``π[j·s : (j+1)·s]``; each client's indices are shuffled.

Semantics and random stream are flwr-datasets' ``ShardPartitioner`` with
``num_shards_per_partition = s``: when ``S`` divides ``N`` the assignment is the same for the same
seed (tested). Deviation: flwr-datasets cuts shards of ``⌊N/S⌋`` examples and drops the
``N mod S`` left over; here the ``S`` shards differ in size by at most one and every example
belongs to a client.
"""
from __future__ import annotations

import numpy as np

from fedgalore.federated.partitioners.base import (
    PartitionError,
    Partitioner,
    as_values,
    categories,
    check_clients,
    check_int,
    register,
    shuffle_each,
)

__all__ = ["ShardsPartitioner", "shard_partition"]


def shard_partition(labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int) -> list[np.ndarray]:
    """Client index arrays of the shard split (module doc); disjoint and covering."""
    arr = as_values(labels)
    m = check_clients(num_clients, arr.size)
    s = check_int("shards_per_client", shards_per_client, 1)
    if m * s > arr.size:
        raise PartitionError(f"shards partition: num_clients={m} x shards_per_client={s} = {m * s} shards exceed the "
                             f"{arr.size} examples; use fewer shards per client or fewer clients")
    _, codes = categories(arr)
    shards = np.array_split(np.argsort(codes, kind="stable").astype(np.int64), m * s)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(m * s)
    return shuffle_each([np.concatenate([shards[i] for i in perm[j * s:(j + 1) * s]]) for j in range(m)], rng)


@register
class ShardsPartitioner(Partitioner):
    """:func:`shard_partition` with ``shards_per_client``."""

    kind = "shards"
    fields = ("shards_per_client",)
    example = "shards:2"

    def split(self, values: np.ndarray, num_partitions: int | None, seed: int) -> list[np.ndarray]:
        return shard_partition(values, num_partitions, self.cfg.shards_per_client, seed)
