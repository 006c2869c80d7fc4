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
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["tail_energy", "tail_energy_sketch", "update_space_diagnostics", "drift_diagnostics", "EXACT_MAX_FLOPS"]

#: SVD work (m·n·min(m, n)) up to which the tail energy is exact; above it, the randomized top-r estimate
EXACT_MAX_FLOPS = 2.0e7
#: columns the range finder keeps beyond r (at least r more: flat spectra need it), and its power iterations
_OVERSAMPLE, _POWER_ITERS = 10, 3


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


def update_space_diagnostics(applied: dict[str, torch.Tensor], rank: int, exact: bool = False) -> dict[str, float]:
    """Mean and max tail energy (paper §4.1) over the applied update's matrices: exact for small
    matrices or with ``exact``, the randomized top-r estimate for large ones (module doc)."""
    if not applied:
        return {}

    def one(d: torch.Tensor) -> float:
        m, n = d.shape[0], d.numel() // max(d.shape[0], 1)
        if exact or m * n * min(m, n) <= EXACT_MAX_FLOPS:
            return tail_energy(d, rank)
        return tail_energy_sketch(d, rank)

    vals = [one(d) for d in applied.values()]
    return {"tail_energy_mean": sum(vals) / len(vals), "tail_energy_max": max(vals)}


def drift_diagnostics(client_deltas: Sequence[dict[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, float]:
    """Relative client drift ‖Δ_i − Σ_j p_j Δ_j‖_F / ‖Σ_j p_j Δ_j‖_F (all matrices stacked)."""
    if not client_deltas or not client_deltas[0]:
        return {}
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
