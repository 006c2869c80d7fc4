"""FFA-LoRA (Sun, Li, Li, Ding, ICLR 2024): freeze A everywhere, train and average only B.

T  ``A`` keeps its random non-zero PEFT-law initialisation and is frozen; it is identical on
   every client because every process draws it from the same local generator (option
   ``adapter_seed``), so it is never sent. Each client trains the zero-initialised ``B`` and the
   head with SGD (the paper's reference optimizer, FederatedScope's default; lr from
   ``train.sgd_lr``, else option ``sgd_lr``, else 2e-2 — the reference GLUE config), momentum
   ``train.sgd_momentum``, no weight decay by default (option ``sgd_weight_decay``).
A  ``B̄ ← Σ_i p_i B_i`` (size-weighted; the FedEx-LoRA re-implementation uses an unweighted
   mean) and the head likewise. Exact: ``s·B̄A = Σ_i p_i s·B_i A``. ``W0`` never changes and
   adapters are never re-initialised.
S  none.

Communication: down ``Dense(B̄)`` per adapted matrix + head; up ``Dense(B_i)`` + head — half
of FedIT's adapter bytes when ``Σ m = Σ n`` over the adapted matrices (square layers).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from fedgalore.federated.robust import factored_term
from fedgalore.methods.base import register
from fedgalore.methods.traits import MethodTraits
from fedgalore.methods.lora_common import LoraMethod, LoraSGDOptions, a_key, b_key, check_weights, weighted_sum, w_key
from fedgalore.protocol.payload import Dense, Payload
from fedgalore.protocol.state import ClientContext, RoundContext, ServerState

__all__ = ["FFALoRA"]


@register
class FFALoRA(LoraMethod):
    name = "ffa_lora"
    summary = "LoRA B + head with SGD, A frozen and shared by seed; server averages B (exact)"
    options_class = LoraSGDOptions
    supports_scaffold = True
    #: A averages the uploaded factors and heads (client-level DP: noise on their sum); W0 never changes:
    #: the global model is W0 + s·B̄Ā
    traits = MethodTraits(optimizer="sgd", dp_aggregate="mean", explicit_adapters=True, exact_low_rank=True)

    def scaffold_params(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """B of every adapted module and the head, by their server names (A is frozen)."""
        return {**{b_key(m): self.lora_b(model, m) for m in self.targets}, **self.head_params(model)}

    def train_a(self) -> bool:
        return False

    def init_server_state(self, model: nn.Module) -> ServerState:
        params = {b_key(m): self.lora_b(model, m).detach().float().cpu().clone() for m in self.targets}
        params.update(self.server_heads(model))
        extras = {a_key(m): self.lora_a(model, m).detach().float().cpu().clone() for m in self.targets}
        return ServerState(params=params, extras=extras, meta={"scaling": self.scaling})

    def broadcast(self, state: ServerState, ctx: RoundContext) -> Payload:
        entries: dict[str, Any] = {b_key(m): Dense(state.params[b_key(m)]) for m in self.targets}
        entries.update({n: Dense(state.params[n]) for n in self.heads})
        return Payload(entries, self.round_meta(ctx))

    @torch.no_grad()
    def load_broadcast(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> None:
        for m in self.targets:
            self.assign(self.lora_b(model, m), self.upload_tensor(broadcast, b_key(m)))
        self.load_heads(model, {n: self.upload_tensor(broadcast, n) for n in self.heads})

    @torch.no_grad()
    def upload_entries(self, model: nn.Module) -> dict[str, Any]:
        entries: dict[str, Any] = {b_key(m): Dense(self.lora_b(model, m).detach().cpu().clone()) for m in self.targets}
        entries.update(self.head_entries(self.head_state(model)))
        return entries

    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext) -> dict[str, torch.Tensor]:
        """A: ``B̄ = Σ p_i B_i``; returns ``ΔW̄ = s(B̄ − B_old)A`` (= ``Σ p_i s(B_i − B_old)A``)."""
        p = check_weights(uploads, weights)
        delta: dict[str, torch.Tensor] = {}
        for m in self.targets:
            b_new = weighted_sum([self.upload_tensor(u, b_key(m)) for u in uploads], p)
            delta[w_key(m)] = self.scaling * ((b_new - state.params[b_key(m)]) @ state.extras[a_key(m)])
            state.params[b_key(m)] = b_new
        self.average_heads(state, uploads, p)
        return delta

    def client_deltas(self, state: ServerState, upload: Payload) -> dict[str, torch.Tensor]:
        """``s(B_i − B̄)A`` against the global ``B̄`` the client started from (``state`` before aggregation)."""
        return {
            w_key(m): self.scaling * ((self.upload_tensor(upload, b_key(m)) - state.params[b_key(m)]) @ state.extras[a_key(m)])
            for m in self.targets
        }

    def update_terms(self, state: ServerState, upload: Payload) -> dict[str, list]:
        """``s(B_i − B̄)A`` as one factored term (federation.robust)."""
        return {w_key(m): [factored_term(self.scaling * (self.upload_tensor(upload, b_key(m)) - state.params[b_key(m)].float()),
                                         state.extras[a_key(m)].float())] for m in self.targets}

    @torch.no_grad()
    def load_global(self, model: nn.Module, state: ServerState) -> None:
        for m in self.targets:
            self.assign(self.lora_a(model, m), state.extras[a_key(m)])
            self.assign(self.lora_b(model, m), state.params[b_key(m)])
        self.load_heads(model, {n: state.params[n] for n in self.heads})
