"""``pathological``: every client holds exactly ``classes_per_client`` classes (NIID-Bench's #C=k).

Semantics and random stream are flwr-datasets' ``PathologicalPartitioner`` (after Li et al.,
"Federated Learning on Non-IID Data Silos", 2021): first each client is given its classes, then
every class is cut into as many near-equal consecutive pieces (in data-set order) as clients hold
it, and piece ``i`` goes to the ``i``-th such client. ``class_assignment`` chooses how classes
are given (classes in sorted order, ``K`` of them, ``C = classes_per_client``):

* ``first-deterministic`` (default; the paper's): client ``j`` gets class ``j mod K``, then
  ``C - 1`` more drawn at random;
* ``deterministic``: client ``j`` gets classes ``(j + i) mod K`` for ``i < C``;
* ``random``: client ``j`` gets ``C`` classes drawn without replacement.

The same seed gives flwr-datasets' assignment (tested). Deviation: a class that no client draws
is an error here (flwr-datasets drops its examples with a warning) — every example must belong to a
client; the message says to use more clients or ``first-deterministic`` (which holds every class
as soon as there are at least ``K`` clients).
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

__all__ = ["PathologicalPartitioner", "pathological_partition"]


def _assign_classes(k: int, m: int, c: int, mode: str, rng: np.random.Generator) -> list[list[int]]:
    """The classes (codes) of each of ``m`` clients; the RNG calls of flwr-datasets' partitioner."""
    if mode == "first-deterministic":
        out = []
        for j in range(m):
            held = [j % k]
            while len(held) < c:
                cls = int(rng.choice(k, size=1)[0])
                if cls not in held:
                    held.append(cls)
            out.append(held)
        return out
    if mode == "deterministic":
        return [[(j + i) % k for i in range(c)] for j in range(m)]
    if mode == "random":
        return [[int(x) for x in rng.choice(k, size=c, replace=False)] for _ in range(m)]
    raise PartitionError(f"class_assignment must be first-deterministic, deterministic or random, got {mode!r}")


def pathological_partition(labels: np.ndarray, num_clients: int, classes_per_client: int, seed: int,
                           class_assignment: str = "first-deterministic") -> list[np.ndarray]:
    """Each of ``num_clients`` clients holds ``classes_per_client`` classes (module doc); every
    client's indices are shuffled at the end. Disjoint and covering; :class:`PartitionError`
    when a class would be held by no client or by more clients than it has examples."""
    arr = as_values(labels)
    m = check_clients(num_clients, arr.size)
    c = check_int("classes_per_client", classes_per_client, 1)
    classes, codes = categories(arr)
    k = classes.size
    if c > k:
        raise PartitionError(f"federation.partition.classes_per_client={c} exceeds the {k} classes of the data; "
                             f"use classes_per_client <= {k}")
    rng = np.random.default_rng(seed)
    held = _assign_classes(k, m, c, class_assignment, rng)
    holders = np.zeros(k, dtype=np.int64)
    for h in held:
        holders[h] += 1
    sizes = np.bincount(codes, minlength=k)
    names = classes.tolist()  # Python values: their repr in messages
    unused = [names[i] for i in np.flatnonzero(holders == 0)]
    if unused:
        raise PartitionError(
            f"pathological partition: no client holds class(es) {', '.join(map(repr, unused[:5]))} with "
            f"num_clients={m}, classes_per_client={c}, class_assignment={class_assignment}; their examples would "
            f"belong to nobody: use at least {k} clients, more classes per client, or class_assignment: first-deterministic"
        )
    crowded = np.flatnonzero(holders > sizes)
    if crowded.size:
        i = int(crowded[0])
        raise PartitionError(
            f"pathological partition: class {names[i]!r} has {sizes[i]} examples but {holders[i]} clients hold it; "
            "use fewer clients or fewer classes per client"
        )
    chunks: list[list[np.ndarray]] = [[] for _ in range(m)]
    for cls in range(k):
        pieces = np.array_split(np.flatnonzero(codes == cls).astype(np.int64), holders[cls])
        owners = [j for j in range(m) if cls in held[j]]
        for j, piece in zip(owners, pieces):
            chunks[j].append(piece)
    return shuffle_each([np.concatenate(ch) for ch in chunks], rng)


@register
class PathologicalPartitioner(Partitioner):
    """:func:`pathological_partition` with ``classes_per_client`` and ``class_assignment``."""

    kind = "pathological"
    fields = ("classes_per_client", "class_assignment")
    example = "pathological:2"

    def split(self, values: np.ndarray, num_partitions: int | None, seed: int) -> list[np.ndarray]:
        return pathological_partition(values, num_partitions, self.cfg.classes_per_client, seed,
                                      self.cfg.class_assignment)
