"""Per-round diagnostics of the paper's two mismatches (docs/design.md §3.3).

* Update-space mismatch (paper §4.1): the Eckart–Young distance of the aggregated update to the
  rank-r set, dist_F(ΔW̄, M_{≤r}) = (Σ_{j>r} σ_j(ΔW̄)²)^{1/2}, reported relative to ‖ΔW̄‖_F
  ("tail energy").
* Client drift: ‖ΔW_i − ΔW̄‖_F / ‖ΔW̄‖_F over all adapted matrices, per client.
* Optimizer-state mismatch (paper §4.2): reported by the method's synchronisation operator
  (relative second-moment mismatch across clients before/after sync).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["tail_energy", "update_space_diagnostics", "drift_diagnostics"]


def tail_energy(delta: torch.Tensor, rank: int) -> float:
    """(Σ_{j>r} σ_j²)^{1/2} / (Σ_j σ_j²)^{1/2} of ``delta``; 0 for a zero matrix."""
    s = torch.linalg.svdvals(delta.float()).double()  # fp32 singular values: ample for an energy ratio
    total = float((s * s).sum())
    if total == 0.0:
        return 0.0
    return math.sqrt(max(float((s[rank:] * s[rank:]).sum()), 0.0) / total)


def update_space_diagnostics(applied: dict[str, torch.Tensor], rank: int) -> dict[str, float]:
    if not applied:
        return {}
    vals = [tail_energy(d, rank) for d in applied.values()]
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
