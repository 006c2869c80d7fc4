"""How non-IID a federation is: per-client distances from the pool, on labels and on features.

Pure numpy (arrays in, arrays out), beside the partitioners;
:mod:`fedgalore.job.partition_files` records them in ``partition.json`` (``"heterogeneity"``) and
``fedgalore partition`` prints and draws them.

* :func:`label_tv` — per client the total-variation distance between its category distribution and
  the pool's, ``TV_i = ½ Σ_c |p_ic − p_c|`` (0: the pool's mix; 1: categories the rest never has);
* :func:`label_tv_iid` — what a uniformly random (IID) split of the same pool into clients of the
  same sizes gives for the size-weighted mean TV, in expectation (a seeded simulation): the floor
  that sampling alone produces, so a split reads as skewed only above it;
* :func:`site_sample` — the seeded per-client sample the feature side embeds;
* :func:`feature_shift` — per client the bias-corrected standardised shift of its mean embedding
  from the pool's mean (≈ 0 for an IID split, whatever the site sizes);
* :func:`weighted_mean` — the size-weighted mean of per-client values (the split's one number);
* :func:`label_coverage` — the categories one client alone holds or no client holds, and the
  clients that hold one category only: what a mean TV does not say, and what a run warns about.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["label_tv", "label_tv_iid", "site_sample", "feature_shift", "weighted_mean", "Coverage", "label_coverage"]


@dataclass(frozen=True)
class Coverage:
    """Where a split's categories live (:func:`label_coverage`); indices into the histogram's axes."""

    #: ``(category, client, rows)``: a category that one client alone holds, and its rows there
    single: tuple[tuple[int, int, int], ...]
    #: categories no client holds (0 training rows: all in the validation pool or at dropped sites)
    absent: tuple[int, ...]
    #: ``(client, category)``: a client whose examples are all of one category
    one_class: tuple[tuple[int, int], ...]

    def __bool__(self) -> bool:
        return bool(self.single or self.absent or self.one_class)


def label_coverage(histograms: np.ndarray) -> Coverage:
    """The categories of a clients × categories count table ``H`` that one client alone holds
    (``|{i : H_ic > 0}| = 1``: learned only in the rounds that sample it), those no client holds
    (``Σ_i H_ic = 0``), and the clients holding examples of one category only
    (``|{c : H_ic > 0}| = 1``). A pool of fewer than two categories has nothing to say (an empty
    :class:`Coverage`)."""
    h = np.asarray(histograms, dtype=np.int64)
    if h.ndim != 2:
        raise ValueError(f"histograms must be clients x categories, got shape {h.shape}")
    if h.shape[1] < 2:
        return Coverage((), (), ())
    held = h > 0
    single = tuple((int(c), int(np.flatnonzero(held[:, c])[0]), int(h[:, c].sum()))
                   for c in np.flatnonzero(held.sum(0) == 1))
    absent = tuple(int(c) for c in np.flatnonzero(held.sum(0) == 0))
    one_class = tuple((int(i), int(np.flatnonzero(held[i])[0])) for i in np.flatnonzero(held.sum(1) == 1))
    return Coverage(single, absent, one_class)


def label_tv(histograms: np.ndarray) -> np.ndarray:
    """Per client ``i`` the total-variation distance of its category distribution from the pool's:

        TV_i = ½ Σ_c |p_ic − p_c|,   p_ic = H_ic / Σ_c H_ic,   p_c = Σ_i H_ic / Σ_ic H_ic

    ``histograms``: ``H``, clients × categories counts (the pool is the clients' union). ``TV_i``
    lies in [0, 1]: 0 when the client holds the pool's mix, 1 when it holds only categories of
    mass 0 elsewhere. A client with no examples gets NaN. Returns a float array, one per client."""
    h = np.asarray(histograms, dtype=np.float64)
    if h.ndim != 2:
        raise ValueError(f"histograms must be clients x categories, got shape {h.shape}")
    sizes = h.sum(1)
    total = sizes.sum()
    if total <= 0:
        return np.full(h.shape[0], np.nan)
    pool = h.sum(0) / total
    with np.errstate(invalid="ignore", divide="ignore"):
        p = h / sizes[:, None]
    tv = 0.5 * np.abs(p - pool).sum(1)
    tv[sizes == 0] = np.nan
    return tv


def weighted_mean(values: Sequence[float] | np.ndarray, weights: Sequence[float] | np.ndarray) -> float:
    """``Σ_i w_i v_i / Σ_i w_i`` over the clients whose value is not NaN (NaN when none is);
    with ``w_i`` the clients' sizes, the size-weighted mean a split is summarised by."""
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    ok = ~np.isnan(v) & (w > 0)
    if not ok.any():
        return float("nan")
    return float(np.sum(w[ok] * v[ok]) / np.sum(w[ok]))


def label_tv_iid(histograms: np.ndarray, seed: int = 0, repeats: int | None = None) -> float:
    """The size-weighted mean :func:`label_tv` an IID split of the same pool into clients of the
    same sizes gives, in expectation:

        E[ Σ_i n_i TV_i / Σ_i n_i ]   over uniformly random assignments of the pooled examples
                                      to clients of sizes n_i (without replacement)

    — what ``federation.partition.kind=iid`` draws, for unequal sizes too. Even an IID split is
    not at 0 (a client of n examples over K equally common categories sits at about
    ``√((K − 1)/(2πn))``, 0.08 for n = 90, K = 5): a split reads
    as skewed only as far as its mean TV exceeds this. Estimated by ``repeats`` seeded draws of the
    clients × categories table (sequential multivariate hypergeometric draws of one margin given
    the other, exact in distribution; default: up to 32, fewer for large tables), so it is
    cheap — milliseconds — and the same for the same ``seed``. NaN for an empty pool."""
    h = np.asarray(histograms, dtype=np.int64)
    if h.ndim != 2:
        raise ValueError(f"histograms must be clients x categories, got shape {h.shape}")
    sizes, counts = h.sum(1), h.sum(0)
    m, k = h.shape
    if sizes.sum() <= 0:
        return float("nan")
    rng = np.random.default_rng([int(seed) % 2**32, 0x71D])
    short = min(m, k)
    reps = repeats if repeats is not None else int(np.clip(4000 // max(short, 1), 2, 32))
    means = []
    for _ in range(reps):
        table = np.zeros((m, k), dtype=np.int64)
        if m <= k:  # client by client: its categories from what the earlier clients left
            left = counts.copy()
            for i in range(m):
                table[i] = rng.multivariate_hypergeometric(left, int(sizes[i]))
                left -= table[i]
        else:  # category by category: its examples over the clients' places left
            left = sizes.copy()
            for c in range(k):
                table[:, c] = rng.multivariate_hypergeometric(left, int(counts[c]))
                left -= table[:, c]
        means.append(weighted_mean(label_tv(table), sizes))
    return float(np.mean(means))


def site_sample(parts: Sequence[np.ndarray], cap: int, seed: int = 0) -> list[np.ndarray]:
    """Per client ``min(cap, n_i)`` of its example indices, drawn without replacement (sorted): the
    same rule for every client, so each client's mean embedding is equally precise up to ``cap``
    and a small site is measured on all it holds. Client ``j``'s draw depends only on ``seed``,
    ``j`` and its own indices (another client changing leaves it alone)."""
    if int(cap) < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    out = []
    for j, part in enumerate(parts):
        part = np.asarray(part, dtype=np.int64)
        rng = np.random.default_rng([int(seed) % 2**32, 0xFEA7, j])
        pick = part if len(part) <= cap else rng.choice(part, size=int(cap), replace=False)
        out.append(np.sort(pick))
    return out


def feature_shift(embeddings: np.ndarray, sites: np.ndarray, sizes: Sequence[float] | np.ndarray | None = None,
                  num_sites: int | None = None) -> np.ndarray:
    """Per site ``i`` the bias-corrected standardised shift of its mean embedding from the pool's:

        shift_i = sqrt( max(0, ‖μ̂_i − μ̂‖² / tr Σ̂ − c_i) )

    with ``μ̂_i`` the mean of site ``i``'s ``n_i`` sampled rows of ``embeddings`` (``sites[r]``: the
    site of row ``r``), ``μ̂`` and ``Σ̂`` the mean and covariance of the pool, and ``c_i`` what the
    first term reads, in expectation, when every row comes from one distribution (an IID split),
    so that an IID split reads ≈ 0 whatever the sites' sizes. ``shift_i`` is the distance in units
    of the pool's total standard deviation: ‖δ‖/√(tr Σ) for a site whose mean is moved by δ.

    ``sizes=None`` (every site sampled in proportion, or entirely): the pool is the ``N`` rows,
    ``μ̂`` their mean, ``Σ̂`` their covariance, and ``c_i = 1/n_i − 1/N``.

    ``sizes`` (the sites' full sizes, e.g. ``n_i = min(cap, sizes_i)`` rows sampled from each):
    the pool is weighted to the federation's (site ``i`` by ``w_i = sizes_i / Σ sizes``, spread over
    its rows), so a site that holds most of the data is measured against a pool it dominates, as
    its label TV is; then ``c_i = (1 − 2 w_i)/n_i + Σ_j w_j²/n_j``, which is ``1/n_i − 1/N`` when
    ``w_i = n_i/N``. ``Σ̂`` is the weighted covariance with the reliability correction
    (``Σ_r a_r (x_r − μ̂)(x_r − μ̂)ᵀ / (1 − Σ_r a_r²)``, row weights ``a_r``; ``1/(N − 1)`` unweighted).

    ``num_sites``: the number of sites (default ``max(sites) + 1``). A site without sampled rows
    gets NaN. Returns a float array, one per site."""
    x = np.asarray(embeddings, dtype=np.float64)
    s = np.asarray(sites, dtype=np.int64)
    if x.ndim != 2 or s.shape != (x.shape[0],):
        raise ValueError(f"embeddings must be rows x features and sites one per row; got {x.shape} and {s.shape}")
    m = int(num_sites) if num_sites is not None else (int(s.max()) + 1 if s.size else 0)
    if s.size and (s.min() < 0 or s.max() >= m):
        raise ValueError(f"site ids must lie in [0, {m})")
    n = np.bincount(s, minlength=m).astype(np.float64)
    w = n.copy() if sizes is None else np.asarray(sizes, dtype=np.float64).copy()
    if w.shape != (m,):
        raise ValueError(f"sizes must hold one value per site ({m}), got shape {w.shape}")
    w[n == 0] = 0.0  # a site without rows cannot stand for its share
    out = np.full(m, np.nan)
    if w.sum() <= 0 or x.shape[0] < 2:
        return out
    w = w / w.sum()
    has = n > 0
    row_w = (w / np.where(has, n, 1.0))[s]  # a_r: sums to 1
    mu = row_w @ x
    dev = x - mu
    denom = 1.0 - np.sum(row_w ** 2)
    trace = float(row_w @ np.einsum("ij,ij->i", dev, dev)) / denom if denom > 0 else 0.0
    if trace <= 0:  # every row the same: no site differs
        out[has] = 0.0
        return out
    sums = np.zeros((m, x.shape[1]))
    np.add.at(sums, s, x)
    means = sums[has] / n[has, None]
    floor = np.sum(w[has] ** 2 / n[has])
    c = (1.0 - 2.0 * w[has]) / n[has] + floor
    d2 = np.sum((means - mu) ** 2, axis=1) / trace
    out[has] = np.sqrt(np.maximum(0.0, d2 - c))
    return out
