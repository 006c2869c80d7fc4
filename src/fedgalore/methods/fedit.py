"""FedIT (Zhang et al., "Towards Building the Federated GPT"): average the LoRA factors separately.

T  every client trains its LoRA ``A``, ``B`` and the head with AdamW, built fresh each round (the
   reference rebuilds its HF Trainer every round), starting from the global ``(Ā, B̄)``.
A  ``Ā ← Σ_i p_i A_i``, ``B̄ ← Σ_i p_i B_i`` (size-weighted over the sampled clients), each
   tensor separately; the head is averaged the same way. The effective global weight is
   ``W0 + s·B̄Ā`` — the product of the averages, *not* the average of the products
   ``Σ_i p_i s·B_i A_i``. The base ``W0`` is never updated and adapters are never re-initialised.
S  none.

Communication: down ``LowRank(B̄, Ā)`` per adapted matrix + head; up ``LowRank(B_i, A_i)`` +
head (both factors, fp32). The reference FedIT path inside the FLoRA repository has a variable
typo that keeps only ``p_1·(A_1, B_1)``; this module follows the Shepherd reference (all clients).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from fedgalore.methods.base import register
from fedgalore.methods.traits import MethodTraits
from fedgalore.protocol.payload import Payload
from fedgalore.protocol.state import RoundContext, ServerState
from fedgalore.methods.lora_common import (
    GlobalFactors,
    a_key,
    b_key,
    check_weights,
    lifted,
    weighted_sum,
    w_key,
)

__all__ = ["FedIT"]


@register
class FedIT(GlobalFactors):
    name = "fedit"
    summary = "LoRA A,B + head with AdamW; server averages A and B separately (Zhang et al.)"
    supports_scaffold = True
    #: A averages the uploaded factors and heads (client-level DP: noise on their sum); W0 never changes:
    #: the global model is W0 + s·B̄Ā (explicit adapters, an update of rank ≤ r)
    traits = MethodTraits(optimizer="adamw", dp_aggregate="mean", explicit_adapters=True, exact_low_rank=True)

    def scaffold_params(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """A and B of every adapted module and the head, by their server names."""
        out: dict[str, nn.Parameter] = {}
        for m in self.targets:
            out[a_key(m)], out[b_key(m)] = self.lora_a(model, m), self.lora_b(model, m)
        out.update(self.head_params(model))
        return out

    def average_factors(self, uploads: Sequence[Payload], weights: Sequence[float], module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B̄, Ā) = (Σ p_i B_i, Σ p_i A_i)."""
        pairs = [self.upload_pair(u, module) for u in uploads]
        return weighted_sum([b for b, _ in pairs], weights), weighted_sum([a for _, a in pairs], weights)

    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext) -> dict[str, torch.Tensor]:
        """A: ``Ā = Σp_iA_i``, ``B̄ = Σp_iB_i``; returns ``ΔW̄ = s(B̄Ā − B_oldA_old)`` per matrix."""
        p = check_weights(uploads, weights)
        delta: dict[str, torch.Tensor] = {}
        for m in self.targets:
            b_new, a_new = self.average_factors(uploads, p, m)
            old = lifted(state.params[b_key(m)], state.params[a_key(m)], self.scaling)
            delta[w_key(m)] = lifted(b_new, a_new, self.scaling) - old
            state.params[a_key(m)], state.params[b_key(m)] = a_new, b_new
        self.average_heads(state, uploads, p)
        return delta

