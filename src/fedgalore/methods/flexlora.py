"""FlexLoRA (Bai et al., NeurIPS 2024): aggregate the products, hand each site the best
approximation at its own rank.

T  client ``i`` (rank ``r_i``: ``federation.site_ranks``, else ``method.rank``) starts from the
   rank-``r_i`` truncation ``(B_i, A_i)`` of the global LoRA weight and trains it and the head with
   AdamW, built fresh each round.
A  per adapted matrix, the paper's global LoRA weight and its SVD (§3, the aggregation and
   redistribution equations; reference/algorithms.md §4b.4 (c), (d)):

       G = Σ_i p_i s B_i A_i = U Σ Vᵀ,
       B_j = U[:, :r_j] Σ[:r_j] / s,    A_j = V[:, :r_j]ᵀ,

   so ``s·B_jA_j`` is the best rank-``r_j`` approximation of ``G`` in Frobenius and spectral norm
   (Eckart–Young). All singular values go into ``B``, as in the reference. ``W0`` never changes
   and the head is averaged. The SVD is of the stacked factors ``[s·B_1 … s·B_K]``,
   ``[p_1A_1; …; p_KA_K]`` (two thin QRs and an SVD of their ``Σr_i × Σr_i`` core, exact to fp32
   rounding; a dense SVD of ``G`` when ``Σ r_i ≥ min(m, n)``), signs fixed (largest entry of each
   ``u_k`` positive) so every run picks the same factors.
S  none.

The server keeps the truncation at the largest site rank ``R`` (``R = r`` without site ranks):
``(U[:, :R] Σ[:R] / s, V[:, :R]ᵀ)``. Its evaluation model is ``W0 + s·B A`` — the model a rank-``R``
site receives, as in the reference, where every model is evaluated as received — not the
untruncated ``G`` (the sum of the products is never stored; the round's ``ΔW̄`` diagnostics are
those of the truncated model).

Deviations, named: the scaling is the method's ``s = α/r`` at every site (PEFT's ``α_i = 2·r_i``
rule, fedgalore.methods.lora_common) — the reference fixes α = 16, so ``s_i = 16/r_i`` differs per
site; the reference trains with SGD under its default ``fedavg`` baseline flag and AdamW otherwise:
AdamW here. The reference never runs heterogeneous ranks (its resize function is never called,
§4b.4 (f) 1): sites here do train at their own ranks.

Communication, per adapted matrix: up ``LowRank(B_i, A_i)`` at the site's rank (``r_i(m+n)``
values) + the head. Down: ``LowRank(B, A)`` at rank ``R`` (``R(m+n)`` values) + the head, the same
message for every client — a site at ``r_j < R`` keeps the leading ``r_j`` columns and rows
(nested: the SVD's leading ``r_j`` pairs are the rank-``r_j`` truncation), so the round loop's
common broadcast serves every rank, at ``(R − r_j)(m+n)`` values a site discards (the reference's
per-client message would be ``r_j(m+n)``).

Client-level DP and secure aggregation: the SVD uses each client's product ``B_iA_i``, so each
upload is used on its own (``dp_aggregate = "individual"``) and SecAgg+ is refused. Robust
aggregation compares ``s(B_iA_i − B[:, :r_i]A[:r_i])``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from fedgalore.methods.base import register
from fedgalore.methods.traits import MethodTraits
from fedgalore.methods.lora_common import LoraOptions, NestedFactorsMethod

__all__ = ["FlexLoRA", "truncated_svd_of_product"]


def _fix_signs(u: torch.Tensor, vh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    idx = u.abs().argmax(dim=0)
    sign = torch.sign(u[idx, torch.arange(u.shape[1])])
    sign[sign == 0] = 1.0
    return u * sign, vh * sign[:, None]


def truncated_svd_of_product(left: torch.Tensor, right: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U_k, σ_k, V_kᵀ)`` of ``G = left @ right`` (``m×q`` · ``q×n``), fp32: through thin QRs of
    the factors when ``q < min(m, n)``, else a dense SVD of ``G``; the top ``k`` pairs (``k`` may
    exceed the rank: the extra singular values are zero), signs fixed."""
    left, right = left.float(), right.float()
    m, q = left.shape
    n = right.shape[1]
    if q < min(m, n):
        ql, rl = torch.linalg.qr(left)  # m×q, q×q
        qr_, rr = torch.linalg.qr(right.T)  # n×q, q×q
        uc, sv, vch = torch.linalg.svd(rl @ rr.T)
        u, vh = ql @ uc, vch @ qr_.T
    else:
        u, sv, vh = torch.linalg.svd(left @ right, full_matrices=False)
    kk = min(k, sv.shape[0])
    u, vh = _fix_signs(u[:, :kk], vh[:kk])
    sv = sv[:kk]
    if kk < k:  # rank below k: zero singular pairs (orthonormality is not needed for zeros)
        u = torch.cat([u, torch.zeros(m, k - kk)], dim=1)
        sv = torch.cat([sv, torch.zeros(k - kk)])
        vh = torch.cat([vh, torch.zeros(k - kk, n)], dim=0)
    return u.contiguous(), sv, vh.contiguous()


@register
class FlexLoRA(NestedFactorsMethod):
    name = "flexlora"
    summary = "LoRA A,B at each site's rank + head with AdamW; server SVDs Σp_i s B_iA_i, each site gets its best rank-r_i part"
    options_class = LoraOptions
    #: the SVD uses each client's product B_iA_i; the uploads are of each site's own rank
    traits = MethodTraits(optimizer="adamw", dp_aggregate="individual", site_ranks=True)

    def combine(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float],
                module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``G = Σ p_i s B_iA_i`` → ``(U_R Σ_R / s, V_Rᵀ)`` with ``R`` the frame rank (module doc)."""
        left = torch.cat([self.scaling * b.float() for b, _ in pairs], dim=1)
        right = torch.cat([float(p) * a.float() for p, (_, a) in zip(weights, pairs)], dim=0)
        u, sv, vh = truncated_svd_of_product(left, right, self.frame_rank)
        return u * (sv / self.scaling), vh
