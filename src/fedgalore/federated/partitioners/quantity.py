"""``quantity``: clients of skewed sizes, labels IID (quantity skew).

The examples are shuffled (a seeded permutation ``π``) and cut into consecutive blocks of the
clients' sizes, so every client's label mix is the pool's up to sampling noise; only the sizes
differ. ``size_skew`` chooses the sizes of ``M`` clients over ``N`` examples:

* ``dirichlet`` (default; NIID-Bench's quantity skew, Li et al. 2021): proportions
  ``q ~ Dir(alpha · 1_M)``; every client gets ``min_size`` examples (at least 1) and the remaining
  ``R = N − M·min_size`` are cut at ``⌊cumsum(q) · R⌋``, so client ``j`` holds
  ``min_size + (its share of R)``. Deviation from NIID-Bench, which redraws ``q`` until
  ``min_j q_j N >= min_size``: with many clients and a small ``alpha`` that rejection loop rarely
  ends (20 clients, ``alpha = 0.5``, 1,781 examples: about 3 draws in 1,000 pass), so the floor is
  given first and one draw splits the rest — a local generator, one draw, never a retry.
* ``power``: sizes proportional to ``(j+1)^power`` for client ``j`` (``power = 1``: linear,
  ``2``: square), each ``⌊share · N⌋`` with the remainder given to the last (largest) client —
  flwr-datasets' ``LinearPartitioner`` / ``SquarePartitioner`` (``IdToSizeFncPartitioner``) on the
  data set shuffled with the same seed, as ``FederatedDataset(shuffle=True)`` does (tested equal).
  ``min_size`` does not apply (the sizes are fixed); every client needs one example.
"""
from __future__ import annotations

import math

import numpy as np

from fedgalore.federated.partitioners.base import (
    PartitionError,
    Partitioner,
    as_values,
    check_clients,
    check_int,
    check_positive,
    register,
)

__all__ = ["QuantityPartitioner", "quantity_sizes", "quantity_partition"]


def quantity_sizes(n: int, num_clients: int, size_skew: str, rng: np.random.Generator, alpha: float = 0.5,
                   power: float = 1.0, min_size: int = 10) -> np.ndarray:
    """The ``M`` client sizes (summing to ``n``) of the rule ``size_skew`` (module doc)."""
    m = check_clients(num_clients, n)
    if size_skew == "power":
        if not math.isfinite(float(power)) or power < 0:
            raise PartitionError(f"federation.partition.power={power!r} must be a finite number >= 0")
        units = np.linspace(1, m, m) ** float(power)
        sizes = np.array(units / units.sum() * n, dtype=np.int64)
        sizes[-1] += n - sizes.sum()
        if sizes.min() < 1:
            raise PartitionError(f"quantity partition: size_skew=power with power={power:g} leaves client 0 without "
                                 f"examples (N={n}, num_clients={m}); lower power or use fewer clients")
        return sizes
    if size_skew != "dirichlet":
        raise PartitionError(f"size_skew must be dirichlet or power, got {size_skew!r}")
    a = check_positive("alpha", alpha)
    min_size = max(check_int("min_size", min_size, 0), 1)  # no empty client
    if min_size * m > n:
        raise PartitionError(f"min_size={min_size} x num_clients={m} = {min_size * m} exceeds N={n}; "
                             "lower min_size or use fewer clients")
    rest = n - min_size * m
    cuts = (np.cumsum(rng.dirichlet(np.full(m, a))) * rest).astype(np.int64)[:-1]
    return min_size + np.diff(np.concatenate([[0], cuts, [rest]]))


def quantity_partition(n: int, num_clients: int, seed: int, size_skew: str = "dirichlet", alpha: float = 0.5,
                       power: float = 1.0, min_size: int = 10) -> list[np.ndarray]:
    """Shuffle ``range(n)`` (``π`` from the seeded generator) and cut it into blocks of
    :func:`quantity_sizes`; disjoint and covering."""
    n = check_int("n", n, 1)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n).astype(np.int64)
    sizes = quantity_sizes(n, num_clients, size_skew, rng, alpha, power, min_size)
    return [p.copy() for p in np.split(perm, np.cumsum(sizes)[:-1])]


@register
class QuantityPartitioner(Partitioner):
    """:func:`quantity_partition` with ``size_skew``, ``alpha`` / ``power``, ``min_size``."""

    kind = "quantity"
    fields = ("size_skew", "alpha", "power", "min_size")
    example = "quantity:0.5"

    def split(self, values: np.ndarray, num_partitions: int | None, seed: int) -> list[np.ndarray]:
        c = self.cfg
        return quantity_partition(len(as_values(values)), num_partitions, seed, c.size_skew, c.alpha, c.power,
                                  c.min_size)

    def options(self) -> dict:
        """``size_skew`` and the options of that rule."""
        keys = ("power",) if self.cfg.size_skew == "power" else ("alpha", "min_size")
        return {"size_skew": self.cfg.size_skew, **{k: getattr(self.cfg, k) for k in keys}}

    def setting(self) -> str:
        """``quantity:<alpha>`` (Dirichlet sizes) or ``quantity:power<p>``."""
        return f"power{self.cfg.power:g}" if self.cfg.size_skew == "power" else f"{self.cfg.alpha:g}"

    @classmethod
    def parse_setting(cls, param: str) -> dict:
        if param.startswith("power"):
            try:
                return {"size_skew": "power", "power": float(param[5:])}
            except ValueError:
                pass
        else:
            try:
                return {"size_skew": "dirichlet", "alpha": float(param)}
            except ValueError:
                pass
        raise PartitionError(f"partition setting quantity:{param!r}: expected quantity:<alpha> (Dirichlet sizes, "
                             "e.g. quantity:0.5) or quantity:power<p> (e.g. quantity:power1)")
