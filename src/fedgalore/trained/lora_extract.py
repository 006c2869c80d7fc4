"""A rank-R LoRA adapter extracted from a weight change by truncated SVD (``fedgalore export
--format peft --rank R``).

For an adapted matrix with pretrained weight ``W0`` and exported weight ``W``, the change
``ΔW = W − W0 = U S Vᵀ`` (thin SVD, singular values ``σ_1 ≥ σ_2 ≥ …``) is replaced by its best
rank-``R`` approximation (Eckart–Young): ``B = U_R S_R^{1/2}`` (m×R), ``A = S_R^{1/2} V_Rᵀ`` (R×n),
with PEFT's scaling ``s = α/r = 1`` (``lora_alpha = R``), so the adapter's ``W0 + s·BA`` is
``W0 + ΔW_R``. What is lost is the SVD tail: the relative Frobenius error

    ‖ΔW − BA‖_F / ‖ΔW‖_F = sqrt(Σ_{i>R} σ_i²) / sqrt(Σ_i σ_i²),

and over all matrices ``sqrt(Σ_matrices tail²) / sqrt(Σ_matrices ‖ΔW‖_F²)``. A change of
numerical rank ≤ R is kept exactly (to fp32 rounding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["LoraFactors", "lora_factors", "total_error", "RANK_NOTES"]

#: what bounds the rank of ΔW = W_R − W0 per method (R rounds, K clients per round, rank r):
#: printed with an extraction so a user knows what a rank-R adapter can and cannot keep
RANK_NOTES: dict[str, str] = {
    "fedgalore": "FedGaLore's update is a sum over rounds and clients of rank-≤r steps on changing projector bases "
                 "(rank ≤ R·K·r·(refreshes per round), far above r after a few rounds) plus the decoupled weight decay "
                 "−ηλW, which is full rank when train.weight_decay > 0: a rank-R adapter keeps the top R directions",
    "fedavg_full": "FedAvg-Full trains the dense matrices: its update has full rank in general",
    "fedit": "FedIT's update is s·B̄Ā: rank ≤ r, kept exactly by --rank ≥ r",
    "ffa_lora": "FFA-LoRA's update is s·B̄A: rank ≤ r, kept exactly by --rank ≥ r",
    "lora_fair": "LoRA-FAIR's update is s·B̄'Ā: rank ≤ r, kept exactly by --rank ≥ r",
    "flora": "FLoRA merges s·Σ_i p_i B_i A_i every round: rank ≤ R·K·r",
    "fr_lora": "FR-LoRA merges s(B̄Ā − B0A0) every round: rank ≤ R·r (A frozen) or 2·R·r",
}
RANK_NOTES["fedgalore_minus"] = RANK_NOTES["fedgalore_mean"] = RANK_NOTES["fedgalore"]


@dataclass
class LoraFactors:
    """``B`` (m×R) and ``A`` (R×n) with ``BA`` the best rank-R approximation of ``delta``, and
    what the truncation cost."""

    b: torch.Tensor
    a: torch.Tensor
    #: ``‖ΔW − BA‖_F / ‖ΔW‖_F`` (0 for ΔW = 0)
    rel_error: float
    #: ``sqrt(Σ_{i>R} σ_i²)`` — the absolute error
    tail: float
    #: ``‖ΔW‖_F``
    norm: float
    #: singular values above ``max(m, n)·ε·σ_1`` (fp32 ε): the numerical rank of ΔW
    numerical_rank: int


def lora_factors(delta: torch.Tensor, rank: int) -> LoraFactors:
    """The rank-``rank`` LoRA factors of ``delta`` (module docstring), in fp32 on ``delta``'s device."""
    d = delta.detach().float()
    if not 1 <= rank <= min(d.shape):
        raise ValueError(f"rank {rank} must be in 1..{min(d.shape)} for a {tuple(d.shape)} matrix")
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    root = s[:rank].clamp_min(0).sqrt()
    b = u[:, :rank] * root
    a = root[:, None] * vh[:rank]
    energy = s.double().pow(2)
    norm, tail = math.sqrt(float(energy.sum())), math.sqrt(float(energy[rank:].sum()))
    eps = torch.finfo(torch.float32).eps
    nrank = int((s > max(d.shape) * eps * float(s[0])).sum()) if s.numel() and float(s[0]) > 0 else 0
    return LoraFactors(b.contiguous(), a.contiguous(), tail / norm if norm > 0 else 0.0, tail, norm, nrank)


def total_error(factors: Sequence[LoraFactors]) -> float:
    """``sqrt(Σ tail²) / sqrt(Σ ‖ΔW‖²)`` over the matrices (0 when nothing changed)."""
    norm = math.sqrt(sum(f.norm ** 2 for f in factors))
    return math.sqrt(sum(f.tail ** 2 for f in factors)) / norm if norm > 0 else 0.0
