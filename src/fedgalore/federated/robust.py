"""Byzantine-robust aggregation rules as pure functions (Krum / Multi-Krum, norm filtering,
coordinate-wise median and trimmed mean).

Client updates are kept in the form they travel in: each matrix's update is a short list of
additive :class:`Term` s — a scaled dense tensor, or a factored product ``L @ R``. Krum needs
only the pairwise squared distances ``‖u_i − u_j‖²``, and those follow from the Gram matrix
``G[i, j] = ⟨u_i, u_j⟩_F`` (:func:`gram`), which :func:`inner` evaluates from the factors without
ever forming an ``m × n`` matrix from them (the cost of a factored pair is ``O((m + n) r1 r2)``).

Rules and their references:

* Krum and Multi-Krum — Blanchard, El Mhamdi, Guerraoui, Stainer 2017, "Machine learning with
  adversaries: Byzantine tolerant gradient descent" (NeurIPS); :func:`krum_scores`,
  :func:`krum_select`. Same choice as Flower's ``flwr.server.strategy.aggregate.aggregate_krum``.
* Coordinate-wise median and trimmed mean — Yin, Chen, Ramchandran, Bartlett 2018,
  "Byzantine-robust distributed learning: towards optimal statistical rates" (ICML);
  :func:`coordinate_median` (Flower's ``aggregate_median``) and :func:`trimmed_mean` (Flower's
  ``aggregate_trimmed_avg`` / ``_trim_mean``, i.e. ``scipy.stats.trim_mean``).
* Norm filtering relative to the round's median norm — :func:`norm_filter`; a median-relative,
  drop-instead-of-clip variant of the norm bound of Sun, Kairouz, Suresh, McMahan 2019, "Can you
  really backdoor federated learning?". Flower has no counterpart.

Nothing here knows about methods, the engine or Flower: everything works on tensors, lists of
terms and payload entries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from fedgalore.protocol.payload import Dense, GaLoreUpdate, LowRank, SeededLowRank

__all__ = [
    "Term",
    "dense_term",
    "factored_term",
    "update_terms",
    "inner",
    "gram",
    "sq_distances",
    "krum_scores",
    "krum_select",
    "norm_filter",
    "coordinate_median",
    "trimmed_mean",
]

_F64 = torch.float64
# coordinates per chunk in the coordinate-wise rules: K * chunk float64 values (~32 MiB) at a time
_CHUNK_VALUES = 1 << 22


@dataclass(frozen=True)
class Term:
    """One additive piece of a client's update of one matrix.

    Dense: ``coef · dense`` (``left``/``right`` are ``None``). Factored: ``coef · left @ right``
    with ``left`` (m×r), ``right`` (r×n) (``dense`` is ``None``). Build with :func:`dense_term` or
    :func:`factored_term`.
    """

    dense: torch.Tensor | None = None
    coef: float = 1.0
    left: torch.Tensor | None = None
    right: torch.Tensor | None = None

    @property
    def is_dense(self) -> bool:
        return self.dense is not None

    @property
    def shape(self) -> tuple[int, ...]:
        if self.dense is not None:
            return tuple(self.dense.shape)
        return (int(self.left.shape[0]), int(self.right.shape[1]))  # type: ignore[union-attr]

    def materialize(self) -> torch.Tensor:
        """The term as a float64 tensor (for tests and small matrices; :func:`inner` never does this)."""
        if self.dense is not None:
            return self.coef * self.dense.to(_F64)
        return self.coef * (self.left.to(_F64) @ self.right.to(_F64))  # type: ignore[union-attr]


def dense_term(t: torch.Tensor, coef: float = 1.0) -> Term:
    """The dense term ``coef · t``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"dense_term needs a torch.Tensor, got {type(t).__name__}")
    return Term(dense=t, coef=float(coef))


def factored_term(left: torch.Tensor, right: torch.Tensor, coef: float = 1.0) -> Term:
    """The factored term ``coef · left @ right`` with ``left`` (m×r) and ``right`` (r×n)."""
    if left.dim() != 2 or right.dim() != 2 or left.shape[1] != right.shape[0]:
        raise ValueError(
            f"factored_term needs left (m×r) and right (r×n), got {tuple(left.shape)} and "
            f"{tuple(right.shape)}"
        )
    return Term(coef=float(coef), left=left, right=right)


def update_terms(entry, base: torch.Tensor | None = None, *, key: str | None = None) -> list[Term]:
    """The terms of a payload entry's update ``ΔW``.

    * ``Dense(X)`` → ``[X]``;
    * ``LowRank`` / ``SeededLowRank`` → ``[L @ R]`` with ``(L, R) = entry.factors()``;
    * ``GaLoreUpdate(decay, terms, shape)`` (``ΔW = decay · W0 + Σ_q term_q``) → each term as
      ``L_q @ R_q``, plus the dense term ``decay · base`` when ``decay != 0`` (``base`` is ``W0``,
      the matrix the update started from; ``ValueError`` if it is missing). ``key`` only names the
      entry in that message.

    Any other entry type raises ``TypeError``.
    """
    if isinstance(entry, Dense):
        return [dense_term(entry.tensor)]
    if isinstance(entry, (LowRank, SeededLowRank)):
        return [factored_term(*entry.factors())]
    if isinstance(entry, GaLoreUpdate):
        out = [factored_term(*t.factors()) for t in entry.terms]
        if entry.decay != 0.0:
            name = f"entry {key!r}" if key is not None else "a GaLoreUpdate entry"
            if base is None:
                raise ValueError(
                    f"{name} has weight decay {entry.decay} (ΔW = decay·W0 + Σ terms) and needs its "
                    f"base matrix W0: pass base=W0"
                )
            if tuple(base.shape) != tuple(entry.shape):
                raise ValueError(
                    f"{name}: base W0 has shape {tuple(base.shape)}, the update {tuple(entry.shape)}"
                )
            out.append(dense_term(base, coef=entry.decay))
        return out
    raise TypeError(
        f"update_terms: {type(entry).__name__} is not an update entry "
        f"(Dense, LowRank, SeededLowRank or GaLoreUpdate)"
    )


def _as64(t: Term) -> Term:
    if t.dense is not None:
        return Term(dense=t.dense.to(_F64), coef=t.coef)
    return Term(coef=t.coef, left=t.left.to(_F64), right=t.right.to(_F64))  # type: ignore[union-attr]


def _inner_terms(a: Term, b: Term) -> torch.Tensor:
    """``⟨a, b⟩_F`` of two float64 terms, as a 0-d float64 tensor."""
    if a.shape != b.shape:
        raise ValueError(f"inner: terms of shapes {a.shape} and {b.shape} do not match")
    c = a.coef * b.coef
    if a.dense is not None and b.dense is not None:
        return c * (a.dense * b.dense).sum()
    if a.dense is not None or b.dense is not None:
        d, f = (a, b) if a.dense is not None else (b, a)
        # ⟨A, L R⟩ = Σ (Lᵀ A) ∘ R      (r×n)
        return c * ((f.left.T @ d.dense) * f.right).sum()  # type: ignore[union-attr]
    # ⟨L1 R1, L2 R2⟩ = Σ (L1ᵀ L2) ∘ (R1 R2ᵀ)      (r1×r2)
    return c * ((a.left.T @ b.left) * (a.right @ b.right.T)).sum()  # type: ignore[union-attr]


def _inner64(a: Sequence[Term], b: Sequence[Term]) -> torch.Tensor:
    total = torch.zeros((), dtype=_F64)
    for ta in a:
        for tb in b:
            total = total + _inner_terms(ta, tb).cpu()
    return total


def inner(a: Sequence[Term], b: Sequence[Term]) -> float:
    """Frobenius inner product ``⟨Σ_p a_p, Σ_q b_q⟩_F = Σ_{p,q} ⟨a_p, b_q⟩_F`` in float64.

    No ``m × n`` matrix is formed from factors: dense·dense ``c_a c_b Σ A ∘ B``; dense·factored
    ``⟨A, L R⟩ = Σ (Lᵀ A) ∘ R`` (an r×n product); factored·factored
    ``⟨L1 R1, L2 R2⟩ = Σ (L1ᵀ L2) ∘ (R1 R2ᵀ)`` (r1×r2).
    """
    return float(_inner64([_as64(t) for t in a], [_as64(t) for t in b]))


def gram(updates: Sequence[dict[str, Sequence[Term]]]) -> torch.Tensor:
    """Gram matrix of the clients' whole updates, ``G[i, j] = Σ_key ⟨u_i[key], u_j[key]⟩_F``
    (K×K, float64; :func:`inner` per key, each unordered pair computed once and mirrored).

    A key missing from a client is a zero update there (it adds nothing to any of its entries).
    """
    k = len(updates)
    ups = [{key: [_as64(t) for t in terms] for key, terms in u.items()} for u in updates]
    g = torch.zeros((k, k), dtype=_F64)
    for i in range(k):
        for j in range(i, k):
            total = torch.zeros((), dtype=_F64)
            for key, terms in ups[i].items():
                other = ups[j].get(key)
                if other is not None:
                    total = total + _inner64(terms, other)
            g[i, j] = total
            g[j, i] = total
    return g


def sq_distances(G: torch.Tensor) -> torch.Tensor:
    """Squared Euclidean distances from a Gram matrix:
    ``D[i, j] = max(0, G[i, i] + G[j, j] − 2 G[i, j])``, ``D[i, i] = 0`` (float64).

    With dense updates this is Flower's ``aggregate._compute_distances`` (``‖w_i − w_j‖²``).
    """
    g = G.to(_F64)
    diag = torch.diagonal(g)
    d = (diag[:, None] + diag[None, :] - 2.0 * g).clamp_min(0.0)
    d.fill_diagonal_(0.0)
    return d


def _num_neighbours(k: int, num_malicious: int) -> int:
    if num_malicious < 0:
        raise ValueError(f"num_malicious must be >= 0, got {num_malicious}")
    n = k - num_malicious - 2
    if n < 1:
        raise ValueError(
            f"Krum needs K - num_malicious - 2 >= 1 neighbours but K={k}, "
            f"num_malicious={num_malicious}: lower num_malicious to at most {max(k - 3, 0)} "
            f"or aggregate at least {num_malicious + 3} clients"
        )
    return n


def krum_scores(D: torch.Tensor, num_malicious: int) -> torch.Tensor:
    """Krum scores (Blanchard et al. 2017, "Machine learning with adversaries", §4):
    ``s(i) = Σ_{j ∈ N_i} D[i, j]`` where ``N_i`` is the ``K − f − 2`` clients *other than i*
    closest to ``i`` (``f = num_malicious``, ``D`` squared distances, e.g. :func:`sq_distances`).

    Neighbour convention, as in Flower's ``aggregate_krum`` (flwr 1.x ``aggregate.py``):
    ``num_closest = max(1, K − f − 2)`` and ``np.argsort(distance)[1 : num_closest + 1]`` — the
    whole row, zero self-distance included, is sorted and its first (smallest) entry dropped, so
    the score sums ``K − f − 2`` distances to others. Since ``D[i, i] = 0 ≤ D[i, j]``, the dropped
    entry is always a zero and the sums agree even when two clients coincide. Unlike Flower, which
    silently uses one neighbour when ``K − f − 2 < 1``, this raises ``ValueError``.
    Returns a float64 tensor of K scores.
    """
    d = D.to(_F64)
    k = int(d.shape[0])
    n = _num_neighbours(k, num_malicious)
    d = d.clone()
    d.fill_diagonal_(float("inf"))  # self is never a neighbour
    return torch.sort(d, dim=1).values[:, :n].sum(dim=1)


def krum_select(D: torch.Tensor, num_malicious: int, to_keep: int) -> list[int]:
    """Krum (``to_keep = 1``) / Multi-Krum (``to_keep = m > 1``) selection (Blanchard et al. 2017):
    the indices of the ``to_keep`` lowest :func:`krum_scores`, ties broken by lower index,
    returned in ascending order.

    Flower's ``aggregate_krum(results, num_malicious, to_keep)`` returns the chosen client's
    weights (``to_keep = 0`` there; ``1`` gives the same client) or the example-weighted mean of
    the chosen ``to_keep`` clients; this returns only the indices (average them as needed).
    """
    k = int(D.shape[0])
    if not 1 <= to_keep <= k:
        raise ValueError(f"to_keep must be in [1, K={k}], got {to_keep}")
    scores = krum_scores(D, num_malicious).tolist()
    order = sorted(range(k), key=lambda i: (scores[i], i))
    return sorted(order[:to_keep])


def norm_filter(norms: Sequence[float], factor: float) -> list[int]:
    """Indices kept by a median-relative norm bound: ``{i : ‖u_i‖ ≤ factor · median_j ‖u_j‖}``
    (``numpy.median`` of the round's norms, so the mean of the two middle norms for an even K).

    A client scaling its update by more than ``factor`` times the typical norm is dropped (a
    drop-instead-of-clip variant of the norm bound of Sun et al. 2019, "Can you really backdoor
    federated learning?"; no Flower counterpart). ``factor`` must be > 0; no norms give ``[]``.
    Norms are e.g. ``sqrt(diag(gram(...)))``.
    """
    if not factor > 0:
        raise ValueError(f"norm_filter: factor must be > 0, got {factor}")
    arr = np.asarray([float(x) for x in norms], dtype=np.float64)
    if arr.size == 0:
        return []  # no clients this round: nothing to keep
    bound = float(factor) * float(np.median(arr))
    return [i for i, v in enumerate(arr.tolist()) if v <= bound]


def _coordinatewise(tensors: Sequence[torch.Tensor], reduce) -> torch.Tensor:
    if len(tensors) == 0:
        raise ValueError("need at least one client tensor")
    first = tensors[0]
    shape = tuple(first.shape)
    for t in tensors[1:]:
        if tuple(t.shape) != shape:
            raise ValueError(f"client tensors differ in shape: {shape} and {tuple(t.shape)}")
    k = len(tensors)
    numel = first.numel()
    flats = [t.reshape(-1) for t in tensors]
    out = torch.empty(numel, dtype=_F64, device=first.device)
    chunk = max(1, _CHUNK_VALUES // k)
    for s in range(0, numel, chunk):
        e = min(numel, s + chunk)
        stacked = torch.stack([f[s:e].to(device=first.device, dtype=_F64) for f in flats])
        out[s:e] = reduce(torch.sort(stacked, dim=0).values, stacked)
    dtype = first.dtype if first.is_floating_point() else _F64
    return out.reshape(shape).to(dtype)


def coordinate_median(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Coordinate-wise median over clients (Yin et al. 2018, "Byzantine-robust distributed
    learning"): ``out[c] = median_i x_i[c]``, unweighted; for an even K the mean of the two middle
    values, exactly ``np.median(stack, axis=0)`` (not ``torch.median``, which returns the lower
    one). A coordinate with a NaN gives NaN, as numpy does.

    Equals Flower's ``aggregate_median`` (strategy ``FedMedian``) per tensor. Computed in float64
    and returned in the first input's dtype (float64 for non-float inputs).
    """

    def reduce(s: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        k = s.shape[0]
        mid = k // 2
        med = s[mid] if k % 2 == 1 else (s[mid - 1] + s[mid]) / 2.0
        return torch.where(torch.isnan(raw).any(dim=0), torch.full_like(med, float("nan")), med)

    return _coordinatewise(tensors, reduce)


def trimmed_mean(tensors: Sequence[torch.Tensor], beta: float) -> torch.Tensor:
    """Coordinate-wise trimmed mean over clients (Yin et al. 2018, "Byzantine-robust distributed
    learning"): with ``c = int(beta · K)``, sort each coordinate's K values ``x_(1) ≤ … ≤ x_(K)``
    and return ``(1 / (K − 2c)) Σ_{i=c+1}^{K−c} x_(i)``, unweighted; ``beta ∈ [0, 0.5)``.

    Equals Flower's ``aggregate_trimmed_avg`` / ``_trim_mean`` (strategy ``FedTrimmedAvg``) and
    ``scipy.stats.trim_mean(axis=0)``. Computed in float64 and returned in the first input's dtype
    (float64 for non-float inputs).
    """
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"trimmed_mean: beta must be in [0, 0.5), got {beta}")
    cut = int(beta * len(tensors))

    def reduce(s: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        return s[cut : s.shape[0] - cut].mean(dim=0)

    return _coordinatewise(tensors, reduce)

