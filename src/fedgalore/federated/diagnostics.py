"""Per-round diagnostics of the paper's two mismatches (docs/design.md §3.3).

* Update-space mismatch (paper §4.1): the Eckart–Young distance of the aggregated update to the
  rank-r set, dist_F(ΔW̄, M_{≤r}) = (Σ_{j>r} σ_j(ΔW̄)²)^{1/2}, reported relative to ‖ΔW̄‖_F
  ("tail energy"). Exact (all singular values) for small matrices; for a large one (more than
  :data:`EXACT_MAX_FLOPS` of SVD work) from its top r singular values by a randomized range
  finder with power iterations (Halko, Martinsson & Tropp 2011, Alg. 4.4): tail² = 1 − Σ_{j≤r}
  σ̂_j² / ‖ΔW̄‖_F², σ̂_j ≤ σ_j, so the estimate errs upwards (never hides a tail): within 1e-3 of the
  exact value where the spectrum falls after r, within 1e-2 on a flat one (tests/engine/test_round_progress.py). A full SVD of
  every adapted matrix of a 135 M-parameter causal LM took most of a CPU round
  (benchmarks/diagnostics_cost.py); ``exact=True`` (``diagnostics_exact: true``) keeps it.
* Client drift: ‖ΔW_i − ΔW̄‖_F / ‖ΔW̄‖_F over all adapted matrices, per client.
* Optimizer-state mismatch (paper §4.2): reported by the method's synchronisation operator
  (relative second-moment mismatch across clients before/after sync).

Two modes (``diagnostics_exact``). **Default: from the factors.** A method whose updates are low-rank
records ``ΔW = a·W + L R`` (FedGaLore: weight decay on the round's ``W`` plus its GaLore terms) hands
them over as :class:`FactoredDelta`, and no ``m × n`` update is formed:

- tail energy (:func:`tail_energy_factored`): ``Q = orth(L)``, ``B = QᵀΔW = a·QᵀW + (QᵀL)R``,
  ``σ̂ = svdvals(B)[:r]``, ``‖ΔW‖_F² = ‖B‖_F² + a²(‖W‖_F² − ‖QᵀW‖_F²)``; one ``m × n × s`` product
  (``s`` the record's stacked rank). Exact when ``a = 0`` (``ΔW`` lives in ``span(L)``); otherwise
  ``σ̂_j ≤ σ_j`` and the estimate of tail² errs upwards by at most ``a²‖(I − QQᵀ)W‖_F² / ‖ΔW‖_F²``
  (the decay's energy outside ``span(L)``; :func:`tail_energy_factored` returns it), a few 1e-4
  at the shipped weight decays (tests/federated/test_diagnostics_modes.py: within 1e-3 of the full SVD);
- drift (:func:`drift_factored`): every ``⟨ΔW_i, ΔW_j⟩`` from the factors' Gram matrices
  (``(LᵀL) ∘ (RRᵀ)``, ``LᵀW``, ``‖W‖²``), accumulated in float64: the same numbers as the dense
  formula up to fp32 rounding (relative 1e-5 in the tests).

Dense updates (the LoRA baselines, FedAvg-Full, a server optimizer's step) take the dense formulas:
exact tail energy for small matrices, the randomized top-r estimate above for large ones.
**``diagnostics_exact: true``**: every update dense, every tail energy by a full SVD — the computation
before the factored mode, bit for bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

import torch

__all__ = ["tail_energy", "tail_energy_sketch", "update_space_diagnostics", "drift_diagnostics", "EXACT_MAX_FLOPS",
           "FactoredDelta", "tail_energy_factored", "drift_factored"]

#: SVD work (m·n·min(m, n)) up to which the tail energy is exact; above it, the randomized top-r estimate
EXACT_MAX_FLOPS = 2.0e7
#: columns the range finder keeps beyond r (at least r more: flat spectra need it), and its power iterations
_OVERSAMPLE, _POWER_ITERS = 10, 3


@dataclass(frozen=True)
class FactoredDelta:
    """An update ``ΔW = scale·base + left @ right`` kept in its factors (module doc): ``left``
    ``m × s``, ``right`` ``s × n`` (fp32), ``base`` the ``m × n`` matrix the decay term scales (a
    reference, read when the diagnostics run; ``None`` when ``scale`` is 0)."""

    left: torch.Tensor
    right: torch.Tensor
    scale: float = 0.0
    base: torch.Tensor | None = None

    @classmethod
    def of(cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], shape: tuple[int, int], scale: float = 0.0,
           base: torch.Tensor | None = None) -> "FactoredDelta":
        """``scale·base + Σ_q L_q R_q`` with the pairs stacked (``[L_1 … L_Q]``, ``[R_1; …; R_Q]``)."""
        pairs = [(a.float(), b.float()) for a, b in pairs if a.shape[1] > 0]
        m, n = shape
        left = torch.cat([a for a, _ in pairs], 1) if pairs else torch.zeros(m, 0)
        right = torch.cat([b for _, b in pairs], 0) if pairs else torch.zeros(0, n)
        return cls(left, right, float(scale), base if scale != 0.0 else None)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.left.shape[0], self.right.shape[1])

    def dense(self) -> torch.Tensor:
        """``ΔW`` as an ``m × n`` matrix."""
        out = self.left @ self.right
        if self.base is not None:
            out.add_(self.base.float(), alpha=self.scale)
        return out


Delta = Union[torch.Tensor, FactoredDelta]


def tail_energy(delta: torch.Tensor, rank: int) -> float:
    """(Σ_{j>r} σ_j²)^{1/2} / (Σ_j σ_j²)^{1/2} of ``delta``, from all its singular values; 0 for a zero matrix."""
    s = torch.linalg.svdvals(delta.float()).double()  # fp32 singular values: ample for an energy ratio
    total = float((s * s).sum())
    if total == 0.0:
        return 0.0
    return math.sqrt(max(float((s[rank:] * s[rank:]).sum()), 0.0) / total)


def tail_energy_sketch(delta: torch.Tensor, rank: int, seed: int = 0) -> float:
    """The tail energy of ``delta`` from its top ``rank`` singular values only (module doc): Y = (AAᵀ)^q AΩ
    with Ω Gaussian n×(r+p) from a generator seeded with ``seed`` (re-orthonormalised between
    products; p = max(10, r), q = 3), Q = qr(Y), σ̂ = svdvals(QᵀA)[:r]; tail = (1 − Σσ̂²/‖A‖_F²)^{1/2} ≥ the exact value."""
    a = delta.float()
    if a.ndim != 2:
        a = a.reshape(a.shape[0], -1)
    m, n = a.shape
    total = float(a.double().square().sum())
    if total == 0.0:
        return 0.0
    k = min(rank + max(_OVERSAMPLE, rank), m, n)
    if k >= min(m, n):  # the sketch would be the whole matrix
        return tail_energy(a, rank)
    g = torch.Generator(device=a.device).manual_seed(int(seed))
    q, _ = torch.linalg.qr(a @ torch.randn(n, k, generator=g, device=a.device, dtype=a.dtype))
    for _ in range(_POWER_ITERS):
        q, _ = torch.linalg.qr(a.T @ q)
        q, _ = torch.linalg.qr(a @ q)
    top = torch.linalg.svdvals(q.T @ a).double()[:rank]
    return math.sqrt(max(1.0 - float(top.square().sum()) / total, 0.0))


def tail_energy_factored(delta: FactoredDelta, rank: int) -> tuple[float, float]:
    """The tail energy of ``ΔW = a·W + L R`` from its factors, and the bound on the error of its
    square (module doc): returns ``(t̂, δ)`` with ``t̂² − δ ≤ tail² ≤ t̂²`` (``δ = 0``: exact up to
    rounding). ``Q = orth(L)``, ``B = a·QᵀW + (QᵀL)R``, ``σ̂ = svdvals(B)[:rank]``."""
    left, right = delta.left, delta.right
    if left.shape[1] == 0:
        q = left
    else:
        q, _ = torch.linalg.qr(left)
    b = (q.T @ left) @ right
    outside = 0.0
    if delta.base is not None and delta.scale != 0.0:
        w = delta.base.float()
        qw = q.T @ w
        b.add_(qw, alpha=delta.scale)
        outside = delta.scale ** 2 * max(float(w.square().sum(dtype=torch.float64)) - float(qw.square().sum(dtype=torch.float64)), 0.0)
    total = float(b.square().sum(dtype=torch.float64)) + outside
    if total == 0.0:
        return 0.0, 0.0
    top = torch.linalg.svdvals(b).double()[:rank] if b.numel() else torch.zeros(0, dtype=torch.float64)
    return math.sqrt(max(1.0 - float(top.square().sum()) / total, 0.0)), outside / total


def update_space_diagnostics(applied: dict[str, Delta], rank: int, exact: bool = False) -> dict[str, float]:
    """Mean and max tail energy (paper §4.1) over the applied update's matrices: from the factors
    for a :class:`FactoredDelta` (its small matrices, and all with ``exact``, densified and exact),
    exact for small dense matrices or with ``exact``, the randomized top-r estimate for large ones (module doc)."""
    if not applied:
        return {}

    def one(d: Delta) -> float:
        if isinstance(d, FactoredDelta):
            m, n = d.shape
            if exact or m * n * min(m, n) <= EXACT_MAX_FLOPS:
                return tail_energy(d.dense(), rank)
            return tail_energy_factored(d, rank)[0]
        m, n = d.shape[0], d.numel() // max(d.shape[0], 1)
        if exact or m * n * min(m, n) <= EXACT_MAX_FLOPS:
            return tail_energy(d, rank)
        return tail_energy_sketch(d, rank)

    vals = [one(d) for d in applied.values()]
    return {"tail_energy_mean": sum(vals) / len(vals), "tail_energy_max": max(vals)}


def drift_diagnostics(client_deltas: Sequence[dict[str, Delta]], weights: Sequence[float]) -> dict[str, float]:
    """Relative client drift ‖Δ_i − Σ_j p_j Δ_j‖_F / ‖Σ_j p_j Δ_j‖_F (all matrices stacked); from
    the factors (:func:`drift_factored`) when every delta is a :class:`FactoredDelta`."""
    if not client_deltas or not client_deltas[0]:
        return {}
    if all(isinstance(v, FactoredDelta) for d in client_deltas for v in d.values()):
        return drift_factored(client_deltas, weights)  # type: ignore[arg-type]
    client_deltas = [{n: v.dense() if isinstance(v, FactoredDelta) else v for n, v in d.items()} for d in client_deltas]
    names = list(client_deltas[0])
    mean = {n: sum(float(w) * d[n].float() for d, w in zip(client_deltas, weights)) for n in names}
    den = math.sqrt(sum(float(m.square().sum(dtype=torch.float64)) for m in mean.values()))
    if den == 0.0:
        return {}
    drifts = [math.sqrt(sum(float((d[n].float() - mean[n]).square().sum(dtype=torch.float64)) for n in names)) / den for d in client_deltas]
    norms = [math.sqrt(sum(float(d[n].float().square().sum(dtype=torch.float64)) for n in names)) for d in client_deltas]
    return {
        "drift_mean": sum(drifts) / len(drifts),
        "drift_max": max(drifts),
        "client_update_norm_mean": sum(norms) / len(norms),
        "aggregate_update_norm": den,
    }


def drift_factored(client_deltas: Sequence[dict[str, FactoredDelta]], weights: Sequence[float]) -> dict[str, float]:
    """:func:`drift_diagnostics` from the factors (module doc): the Gram matrix ``G_ij = Σ_matrices
    ⟨ΔW_i, ΔW_j⟩`` (float64) gives ``drift_i² = G_ii − 2(Gp)_i + pᵀGp``, ``‖ΔW̄‖² = pᵀGp`` and
    ``‖ΔW_i‖² = G_ii``. Each matrix's clients must share one ``base`` (the round's ``W``)."""
    k = len(client_deltas)
    gram = torch.zeros(k, k, dtype=torch.float64)
    for name in client_deltas[0]:
        ds = [d[name] for d in client_deltas]
        sizes = [d.left.shape[1] for d in ds]
        left = torch.cat([d.left for d in ds], 1)
        right = torch.cat([d.right for d in ds], 0)
        prod = ((left.T @ left) * (right @ right.T)).double()  # ⟨L_a R_a, L_b R_b⟩ per column pair
        owner = torch.repeat_interleave(torch.arange(k), torch.tensor(sizes, dtype=torch.long))
        onehot = torch.zeros(k, left.shape[1], dtype=torch.float64)
        onehot[owner, torch.arange(left.shape[1])] = 1.0
        g = onehot @ prod @ onehot.T
        scales = torch.tensor([d.scale if d.base is not None else 0.0 for d in ds], dtype=torch.float64)
        base = next((d.base for d in ds if d.base is not None), None)
        if base is not None:
            if any(d.base is not None and d.base is not base for d in ds):
                raise ValueError(f"{name}: the clients' decay terms scale different matrices")
            w = base.float()
            cross = onehot @ ((left.T @ w) * right).double().sum(1)  # ⟨W, L_i R_i⟩
            g += torch.outer(scales, cross) + torch.outer(cross, scales)
            g += torch.outer(scales, scales) * float(w.square().sum(dtype=torch.float64))
        gram += g
    p = torch.tensor([float(w) for w in weights], dtype=torch.float64)
    den2 = float(p @ gram @ p)
    if den2 <= 0.0:
        return {}
    den = math.sqrt(den2)
    gp = gram @ p
    drifts = [math.sqrt(max(float(gram[i, i] - 2 * gp[i]) + den2, 0.0)) / den for i in range(k)]
    norms = [math.sqrt(max(float(gram[i, i]), 0.0)) for i in range(k)]
    return {
        "drift_mean": sum(drifts) / len(drifts),
        "drift_max": max(drifts),
        "client_update_norm_mean": sum(norms) / len(norms),
        "aggregate_update_norm": den,
    }
