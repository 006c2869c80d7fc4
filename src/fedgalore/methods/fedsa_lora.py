"""FedSA-LoRA (Guo et al., ICLR 2025): share ``A``, keep ``B`` at the site.

T  client ``i`` trains its LoRA ``A``, ``B`` and the head with SGD (the reference's optimizer,
   FederatedScope's default: no momentum, no scheduler of its own; lr from ``train.sgd_lr``, else
   option ``sgd_lr``, else 2e-2 — the reference GLUE config), starting from the global ``Ā`` and
   its *own* ``B_i`` from its last round (``B_i = 0``, PEFT's initialisation, the first time it
   trains). ``B_i`` lives in the client's own store (``ctx.state``) between rounds and never
   leaves the site for training purposes.
A  ``Ā ← Σ_i p_i A_i`` (the paper's aggregation of the shared matrices, size-weighted as the
   reference's ``ClientsAvgAggregator``); the head ``θ ← Σ_i p_i θ_i``. ``B`` is not aggregated
   for training. ``W0`` never changes.
S  none.

The global test set needs *some* ``B`` (deviations, named; option ``global_b``):

* ``mean`` (default): every client also uploads ``B_i`` and the server keeps ``B̄ = Σ_i p_i B_i``
  for its evaluation model ``W0 + s·B̄Ā`` only — nothing sent down carries it, and the clients'
  training is exactly the paper's. Those bytes are counted on the uplink.
* ``none``: only ``A_i`` (and the head) is uploaded, as in the paper; the server's model is
  ``W0 + s·B₀Ā`` with ``B₀ = 0`` — the pretrained model with the averaged head, which says nothing
  of the adapters. Use it for the communication the paper states.

The paper reports a personalised metric: each site's ``(Ā, B_i, head)`` on its own split, the
unweighted mean over sites (§4b.2). ``federation.client_eval`` evaluates the *server's* model on
each site's held-out share, not ``(Ā, B_i)``: it is this implementation's own metric, not the
paper's.

Other deviations: the head is averaged (the reference's GLUE config keeps the classifier local
too); training is in the model's dtype (the reference trains in fp16); the reference's shared
model object (§4b.2 (f) 1, which carries one ``B`` from client to client) is a defect, not copied —
every site keeps its own ``B_i``.

Client state. ``B_i`` is kept in ``ctx.state``, the client's own store: the sequential backend
keeps one per site for a method with the ``keeps_client_state`` trait and writes it with the run after every
round (fedgalore.engine.stages.site_state), so a resumed run continues each site's ``B_i``; a
Flower node keeps it in its ``Context.state``. Ray's workers keep no method state: the config
refuses Ray in one line, and a client that is handed no store raises one (:data:`NEEDS_CLIENT_STATE`).

Communication, per adapted matrix: down ``Dense(Ā)`` (``r·n`` values) + the head; up ``Dense(A_i)``
(``r·n``) + the head, plus ``Dense(B_i)`` (``m·r``) with ``global_b: mean``.

Client-level DP and secure aggregation: ``Ā`` (and ``B̄``) are weighted means of the uploads
(``dp_aggregate = "mean"``): both apply. Robust aggregation (Krum, norm filter) compares each
client's change of the shared factor, ``A_i − Ā`` (``r × n``, keyed by the ``lora_A`` name): the
server never learns a site's starting ``B_i``, so the change of its effective weight
``s(B_iA_i − B_i⁰Ā)`` is not available to it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from torch import nn

from fedgalore.methods.base import MethodError, option, register
from fedgalore.methods.traits import MethodTraits
from fedgalore.methods.lora_common import (
    LoraMethod,
    LoraSGDOptions,
    a_key,
    b_key,
    check_weights,
    lifted,
    w_key,
    weighted_sum,
)
from fedgalore.protocol.payload import Dense, Payload
from fedgalore.protocol.state import ClientContext, RoundContext, ServerState

__all__ = ["FedSALoRA", "FedSALoRAOptions", "NEEDS_CLIENT_STATE"]

#: the one line a stateless backend gets
NEEDS_CLIENT_STATE = ("method fedsa_lora keeps each site's B between rounds in the site's own store (ctx.state), and "
                      "this backend keeps none; use backend.name=sequential or flower, which keep one per site")
_STORE = "fedsa_lora.B"


@dataclass(frozen=True)
class FedSALoRAOptions(LoraSGDOptions):
    global_b: Literal["mean", "none"] = option(
        "mean", "the server's evaluation B: mean of uploaded B_i (clients also upload B; evaluation only) or none (B = 0)")


@register
class FedSALoRA(LoraMethod):
    name = "fedsa_lora"
    summary = "LoRA A,B + head with SGD; server averages A (and the head), each site keeps its own B"
    options_class = FedSALoRAOptions
    #: Ā, B̄ and the head are weighted means of the uploads; B_i stays in the client's own store between rounds
    traits = MethodTraits(optimizer="sgd", dp_aggregate="mean", keeps_client_state=True)

    @property
    def upload_b(self) -> bool:
        return self.options.global_b == "mean"

    def init_server_state(self, model: nn.Module) -> ServerState:
        params: dict[str, torch.Tensor] = {}
        for m in self.targets:
            params[a_key(m)] = self.lora_a(model, m).detach().float().cpu().clone()
            if self.upload_b:
                params[b_key(m)] = self.lora_b(model, m).detach().float().cpu().clone()
        params.update(self.server_heads(model))
        extras = {} if self.upload_b else {b_key(m): self.lora_b(model, m).detach().float().cpu().clone() for m in self.targets}
        return ServerState(params=params, extras=extras, meta={"scaling": self.scaling, "global_b": self.options.global_b})

    def server_b(self, state: ServerState, module: str) -> torch.Tensor:
        """The server's evaluation ``B``: ``B̄`` (``global_b: mean``) or the initial ``B₀ = 0``."""
        return state.params[b_key(module)] if self.upload_b else state.extras[b_key(module)]

    def broadcast(self, state: ServerState, ctx: RoundContext) -> Payload:
        entries: dict[str, Any] = {a_key(m): Dense(state.params[a_key(m)]) for m in self.targets}
        entries.update({n: Dense(state.params[n]) for n in self.heads})
        return Payload(entries, self.round_meta(ctx))

    # ------------------------------------------------------------------ client
    @torch.no_grad()
    def load_broadcast(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> None:
        if ctx.state is None:
            raise MethodError(NEEDS_CLIENT_STATE)
        own = ctx.state.get(_STORE)
        for m in self.targets:
            self.assign(self.lora_a(model, m), self.upload_tensor(broadcast, a_key(m)))
            b = self.lora_b(model, m)
            if own is None:
                b.zero_()  # PEFT's initial B: this site has not trained yet
            else:
                self.assign(b, own[m])
        self.load_heads(model, {n: self.upload_tensor(broadcast, n) for n in self.heads})

    def client_update(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> Payload:
        """T (module doc); the trained ``B_i`` is kept in the site's store for its next round."""
        upload = super().client_update(model, broadcast, ctx)
        ctx.state[_STORE] = {m: self.lora_b(model, m).detach().cpu().clone() for m in self.targets}
        return upload

    @torch.no_grad()
    def upload_entries(self, model: nn.Module) -> dict[str, Any]:
        entries: dict[str, Any] = {a_key(m): Dense(self.lora_a(model, m).detach().cpu().clone()) for m in self.targets}
        if self.upload_b:
            entries.update({b_key(m): Dense(self.lora_b(model, m).detach().cpu().clone()) for m in self.targets})
        entries.update(self.head_entries(self.head_state(model)))
        return entries

    # ------------------------------------------------------------------ server
    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext) -> dict[str, torch.Tensor]:
        """A: ``Ā = Σ p_i A_i`` (and ``B̄ = Σ p_i B_i`` for the server's evaluation model with
        ``global_b: mean``); returns the server model's change ``s(B̄Ā − B̄_oldĀ_old)``."""
        p = check_weights(uploads, weights)
        delta: dict[str, torch.Tensor] = {}
        for m in self.targets:
            old = lifted(self.server_b(state, m), state.params[a_key(m)], self.scaling)
            state.params[a_key(m)] = weighted_sum([self.upload_tensor(u, a_key(m)) for u in uploads], p)
            if self.upload_b:
                state.params[b_key(m)] = weighted_sum([self.upload_tensor(u, b_key(m)) for u in uploads], p)
            delta[w_key(m)] = lifted(self.server_b(state, m), state.params[a_key(m)], self.scaling) - old
        self.average_heads(state, uploads, p)
        return delta

    def client_deltas(self, state: ServerState, upload: Payload) -> dict[str, torch.Tensor]:
        """Each client's change of the shared factor, ``A_i − Ā`` (module doc: the server does not
        know the ``B_i`` the site started from)."""
        return {a_key(m): self.upload_tensor(upload, a_key(m)) - state.params[a_key(m)].float() for m in self.targets}

    @torch.no_grad()
    def load_global(self, model: nn.Module, state: ServerState) -> None:
        for m in self.targets:
            self.assign(self.lora_a(model, m), state.params[a_key(m)])
            self.assign(self.lora_b(model, m), self.server_b(state, m))
        self.load_heads(model, {n: state.params[n] for n in self.heads})
