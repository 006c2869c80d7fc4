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

from typing import Any, Sequence

import torch
from torch import nn

from fedgalore.federated.robust import factored_term
from fedgalore.methods.base import register
from fedgalore.protocol.payload import Dense, LowRank, Payload
from fedgalore.protocol.state import ClientContext, RoundContext, ServerState
from fedgalore.methods.lora_common import (
    LoraMethod,
    a_key,
    b_key,
    check_weights,
    lifted,
    pair_key,
    weighted_sum,
    w_key,
)

__all__ = ["FedIT"]


@register
class FedIT(LoraMethod):
    name = "fedit"
    #: A averages the uploaded factors and heads (client-level DP: noise on their sum)
    dp_aggregate = "mean"
    summary = "LoRA A,B + head with AdamW; server averages A and B separately (Zhang et al.)"
    optimizer_kind = "adamw"
    supports_scaffold = True
    explicit_adapters = True  # W0 never changes: the global model is W0 + s·B̄Ā

    def scaffold_params(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """A and B of every adapted module and the head, by their server names."""
        out: dict[str, nn.Parameter] = {}
        for m in self.targets:
            out[a_key(m)], out[b_key(m)] = self.lora_a(model, m), self.lora_b(model, m)
        out.update(self.head_params(model))
        return out

    def init_server_state(self, model: nn.Module) -> ServerState:
        params: dict[str, torch.Tensor] = {}
        for m in self.targets:
            params[a_key(m)] = self.lora_a(model, m).detach().float().cpu().clone()
            params[b_key(m)] = self.lora_b(model, m).detach().float().cpu().clone()
        params.update(self.server_heads(model))
        return ServerState(params=params, meta={"scaling": self.scaling})

    def broadcast(self, state: ServerState, ctx: RoundContext) -> Payload:
        entries: dict[str, Any] = {pair_key(m): LowRank(state.params[b_key(m)], state.params[a_key(m)]) for m in self.targets}
        entries.update({n: Dense(state.params[n]) for n in self.heads})
        return Payload(entries, self.round_meta(ctx))

    @torch.no_grad()
    def load_broadcast(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> None:
        for m in self.targets:
            b, a = self.upload_pair(broadcast, m)
            self.assign(self.lora_a(model, m), a)
            self.assign(self.lora_b(model, m), b)
        self.load_heads(model, {n: self.upload_tensor(broadcast, n) for n in self.heads})

    def upload_entries(self, model: nn.Module) -> dict[str, Any]:
        return {**self.pair_entries(model), **self.head_entries(self.head_state(model))}

    # ------------------------------------------------------------------ server
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

    def client_deltas(self, state: ServerState, upload: Payload) -> dict[str, torch.Tensor]:
        """``s(B_iA_i − B̄Ā)`` against the global adapters the client started from (``state``
        before aggregation)."""
        out = {}
        for m in self.targets:
            b, a = self.upload_pair(upload, m)
            out[w_key(m)] = lifted(b, a, self.scaling) - lifted(state.params[b_key(m)], state.params[a_key(m)], self.scaling)
        return out

    def update_terms(self, state: ServerState, upload: Payload) -> dict[str, list]:
        """``s(B_iA_i − B̄Ā)`` as two factored terms (federation.robust compares them through their factors)."""
        out = {}
        for m in self.targets:
            b, a = self.upload_pair(upload, m)
            out[w_key(m)] = [factored_term(self.scaling * b, a),
                             factored_term(-self.scaling * state.params[b_key(m)].float(), state.params[a_key(m)].float())]
        return out

    @torch.no_grad()
    def load_global(self, model: nn.Module, state: ServerState) -> None:
        for m in self.targets:
            self.assign(self.lora_a(model, m), state.params[a_key(m)])
            self.assign(self.lora_b(model, m), state.params[b_key(m)])
        self.load_heads(model, {n: state.params[n] for n in self.heads})
