"""HetLoRA (Cho et al., EMNLP 2024): heterogeneous ranks by zero-padding and truncation.

T  client ``k`` (rank ``r_k``: ``federation.site_ranks``, else ``method.rank``) starts from the
   truncation of the global factors, ``B_k = B[:, :r_k]``, ``A_k = A[:r_k, :]`` (the paper's
   distribution step), and trains them and the head with AdamW, built fresh each round.
A  zero-pad each client's factors to the largest rank ``R`` and average them (the paper's
   aggregation, reference/algorithms.md §4b.5):

       B = Σ_k w_k pad(B_k),    A = Σ_k w_k pad(A_k),

   with option ``aggregation``:

   * ``sparsity`` (default; the paper's sparsity-weighted aggregation) — ``w_k = S_k / Σ_j S_j``,
     ``S_k = ‖B_kA_k‖_F``: a client whose update is larger weighs more (the round's weights
     ``p_k`` are not used; when every ``S_k`` is 0 the weights fall back to ``p_k``);
   * ``weights`` — ``w_k = p_k``, the round's weights (what the FlexLoRA authors' HetLoRA
     baseline code does): a weighted mean of the zero-padded uploads; without site ranks this is
     exactly FedIT.

   Factors are averaged separately: ``s·BA`` is not ``Σ_k w_k s·B_kA_k`` (not exact, as the paper).
   ``W0`` never changes; the head is averaged with ``p_k``.
S  none.

Not implemented (named): the paper's local rank self-pruning (the regulariser
``λ‖B_k[:, ⌊γr_k⌋:]‖·‖A_k[⌊γr_k⌋:]‖`` and the rule that lowers ``r_k`` when it shrinks) — the
reference notes its rule as unverified, and a site's rank here stays ``federation.site_ranks``'.
Deviations: the scaling is the method's ``s = α/r`` at every site (PEFT's ``α_i = 2·r_i`` rule,
fedgalore.methods.lora_common; the baseline code rescales each factor by ``√(16/r_k)``); AdamW (no
optimizer is stated in the summaries read).

Communication, per adapted matrix: up ``LowRank(B_k, A_k)`` at the site's rank (``r_k(m+n)``
values) + the head; down ``LowRank(B, A)`` at rank ``R`` (``R(m+n)``) + the head, one message for
every client — each site takes its leading block itself (the truncation), discarding
``(R − r_k)(m+n)`` values.

Client-level DP and secure aggregation: with ``aggregation: weights`` the new factors are a
weighted mean of the zero-padded uploads (``dp_aggregate = "mean"``; SecAgg+ applies when every
site has the same rank — the config refuses site ranks under SecAgg+); with ``sparsity`` the
weights are read from each upload (``individual``; SecAgg+ refused). Robust aggregation compares
``s(B_kA_k − B[:, :r_k]A[:r_k])``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Sequence

import torch

from fedgalore.methods.base import MethodOptions, option, register
from fedgalore.methods.traits import MethodTraits
from fedgalore.methods.lora_common import LoraOptions, NestedFactorsMethod

__all__ = ["HetLoRA", "HetLoRAOptions", "zero_pad"]


def zero_pad(b: torch.Tensor, a: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, A)`` of rank ``r ≤ rank`` zero-padded to ``(m × rank, rank × n)``, fp32."""
    r = b.shape[1]
    bp = torch.zeros(b.shape[0], rank)
    ap = torch.zeros(rank, a.shape[1])
    bp[:, :r], ap[:r] = b.float(), a.float()
    return bp, ap


@dataclass(frozen=True)
class HetLoRAOptions(LoraOptions):
    aggregation: Literal["sparsity", "weights"] = option(
        "sparsity", "factor weights: ‖B_kA_k‖_F-proportional (the paper) or the round's weights p_k (the baseline code)")


@register
class HetLoRA(NestedFactorsMethod):
    name = "hetlora"
    summary = "LoRA A,B at each site's rank + head with AdamW; server zero-pads and averages the factors, sites truncate"
    options_class = HetLoRAOptions
    #: the uploads are of each site's own rank; dp_aggregate follows the option aggregation (:meth:`traits_for`)
    traits = MethodTraits(optimizer="adamw", dp_aggregate="individual", site_ranks=True)

    @classmethod
    def traits_for(cls, options: MethodOptions) -> MethodTraits:
        """Weights p_k: a weighted mean of the (padded) uploads; sparsity weights read each upload."""
        t = super().traits_for(options)
        return replace(t, dp_aggregate="mean") if getattr(options, "aggregation", "sparsity") == "weights" else t

    @classmethod
    def secure_aggregation_problem(cls, options: MethodOptions) -> str | None:
        if getattr(options, "aggregation", "sparsity") == "weights":
            return None
        return ("federation.secure_aggregation: method 'hetlora' with aggregation=sparsity weighs each upload by its own "
                "norm ‖B_kA_k‖, which secure aggregation hides; set method.options.aggregation=weights")

    def factor_weights(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float]) -> list[float]:
        """``w_k``: ``S_k/Σ S_j`` (``sparsity``) or ``p_k`` (``weights``)."""
        if self.options.aggregation == "weights":
            return list(weights)
        norms = [float(torch.linalg.matrix_norm(b.float() @ a.float())) for b, a in pairs]
        total = sum(norms)
        return [n / total for n in norms] if total > 0 else list(weights)

    def combine(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float],
                module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Σ w_k pad(B_k), Σ w_k pad(A_k))`` at the frame rank (module doc)."""
        w = self.factor_weights(pairs, weights)
        padded = [zero_pad(b, a, self.frame_rank) for b, a in pairs]
        b_new = sum(wk * b for wk, (b, _) in zip(w, padded))
        a_new = sum(wk * a for wk, (_, a) in zip(w, padded))
        return b_new, a_new
