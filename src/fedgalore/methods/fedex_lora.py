"""FedEx-LoRA (Singhal, Ponkshe, Vepakomma; ACL 2025, arXiv 2410.09432): FedIT's factor averages
plus the exact residual folded into the base weight.

T  every client trains its LoRA ``A``, ``B`` and the head with AdamW, built fresh each round,
   starting from the global ``(Ā, B̄)`` on the corrected base ``W`` (the adapters are never
   re-initialised; reference/algorithms.md §4b.1 (a), (d)).
A  per adapted matrix (the paper's aggregation, its eqs. for ``A``, ``B`` and ``ΔW_res``):

       Ā = Σ_i p_i A_i,    B̄ = Σ_i p_i B_i,
       ΔW_res = s·(Σ_i p_i B_i A_i − B̄Ā) = s·Σ_i p_i B_i (A_i − Ā),
       W ← W + ΔW_res,

   so the global model ``W + s·B̄Ā`` moves to ``W_old + s·Σ_i p_i B_i A_i`` exactly (the dense mean
   of the clients' products, fp32). The residual carries PEFT's scaling ``s = α/r`` (the code's
   reading; the paper's equations absorb it). The head is averaged with the same weights.
S  none.

Weights (deviation, named): the paper and the reference code average uniformly (``1/K``); here
the weights are the round's ``p_i`` (size-weighted, as every other method of this package, and
what client-level DP or robust aggregation set them to). ``uniform_average: true`` is the literal
``1/K`` mode. The residual is added in the layer's own ``(out, in)`` layout (the reference's
GLUE path adds it transposed to ``nn.Linear`` weights, §4b.1 (f) 1: a defect, not copied).

Communication, per adapted matrix (exact: the payload entries are what travels):

* up: ``LowRank(B_i, A_i)`` under ``<module>.lora`` (``r(m+n)`` values) + the head, as FedIT;
* down: ``LowRank(B̄, Ā)`` (``r(m+n)``) + the head + the base ``W``. Option ``downlink``
  (fedgalore.methods.downlink_mixin, default ``auto`` → ``factored``): a client that holds the
  previous round's ``W`` gets the round's residual as the stacked factors
  ``(s·[B_1 … B_K], [p_1(A_1 − Ā); …; p_K(A_K − Ā)])`` — rank ``K·r``, ``K·r(m+n)`` values,
  growing with the number of clients (the cost the Fed-SB paper points at, §4b.1 (d)) — or the
  chain of such residuals since the version it holds, and ``Dense(W)`` where the chain is gone or
  not smaller (a new client, one that missed rounds); ``downlink: dense`` sends ``Dense(W)`` every
  round (what the reference code does: it loads the whole global state into every client).

Client-level DP and secure aggregation: A multiplies each client's factors (``B_i A_i``), so
each upload is used on its own (``dp_aggregate = "individual"``) and SecAgg+ is refused.
Robust aggregation compares ``s(B_iA_i − B̄Ā)`` as two factored terms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from torch import nn

from fedgalore.methods.base import option, register
from fedgalore.methods.traits import MethodTraits
from fedgalore.methods.downlink_mixin import DOWNLINK_HELP, FactoredDownlink
from fedgalore.methods.lora_common import (
    GlobalFactors,
    LoraOptions,
    a_key,
    b_key,
    check_weights,
    lifted,
    pair_key,
    w_key,
    weighted_sum,
)
from fedgalore.protocol.payload import LowRank, Payload
from fedgalore.protocol.state import ClientContext, RoundContext, ServerState

__all__ = ["FedExLoRA", "FedExLoRAOptions", "fedex_residual"]


def fedex_residual(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], weights: Sequence[float],
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor, LowRank]:
    """``(B̄, Ā, ΔW_res)`` of one matrix: the weighted factor means and the residual
    ``s·Σ_i p_i B_i (A_i − Ā) = s·(Σ_i p_i B_iA_i − B̄Ā)`` as its stacked factors (rank ``K·r``), fp32."""
    b_bar = weighted_sum([b for b, _ in pairs], weights)
    a_bar = weighted_sum([a for _, a in pairs], weights)
    left = torch.cat([scaling * b.float() for b, _ in pairs], dim=1)
    right = torch.cat([float(p) * (a.float() - a_bar) for p, (_, a) in zip(weights, pairs)], dim=0)
    return b_bar, a_bar, LowRank(left, right)


@dataclass(frozen=True)
class FedExLoRAOptions(LoraOptions):
    uniform_average: bool = option(False, "weigh every upload 1/K (the paper and its code) instead of the round's weights p_i")
    downlink: Literal["auto", "dense", "factored"] = option("auto", DOWNLINK_HELP)


@register
class FedExLoRA(FactoredDownlink, GlobalFactors):
    name = "fedex_lora"
    summary = "LoRA A,B + head with AdamW; server averages A and B and folds the exact residual s(Σp_iB_iA_i − B̄Ā) into W"
    options_class = FedExLoRAOptions
    #: A multiplies each client's factors (B_iA_i): each upload is used on its own
    traits = MethodTraits(downlink="factored", optimizer="adamw", dp_aggregate="individual")

    def init_server_state(self, model: nn.Module) -> ServerState:
        params: dict[str, torch.Tensor] = {}
        for m in self.targets:
            params[w_key(m)] = self.base_weight(model, m).detach().float().cpu().clone()
            params[a_key(m)] = self.lora_a(model, m).detach().float().cpu().clone()
            params[b_key(m)] = self.lora_b(model, m).detach().float().cpu().clone()
        params.update(self.server_heads(model))
        return ServerState(params=params, meta={"scaling": self.scaling})

    # ------------------------------------------------------------------ downlink
    def broadcast(self, state: ServerState, ctx: RoundContext) -> Payload:
        msg = self.broadcast_merged(state, ctx)  # Dense(W) per matrix + head
        msg.entries.update({pair_key(m): LowRank(state.params[b_key(m)], state.params[a_key(m)]) for m in self.targets})
        msg.meta.update(self.downlink_meta(state))
        return msg

    def downlink_names(self) -> list[str]:
        return [w_key(m) for m in self.targets]

    def downlink_base(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.merged_downlink_base(model)

    # ------------------------------------------------------------------ client
    @torch.no_grad()
    def load_broadcast(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> None:
        self.load_merged(model, broadcast, self.start_matrices(broadcast, ctx.state))  # W (corrected) + head
        for m in self.targets:
            b, a = self.upload_pair(broadcast, m)
            self.assign(self.lora_a(model, m), a)
            self.assign(self.lora_b(model, m), b)

    def upload_entries(self, model: nn.Module) -> dict[str, Any]:
        return {**self.pair_entries(model), **self.head_entries(self.head_state(model))}

    # ------------------------------------------------------------------ server
    def round_weights(self, uploads: Sequence[Payload], weights: Sequence[float]) -> list[float]:
        p = check_weights(uploads, weights)
        return [1.0 / len(uploads)] * len(uploads) if self.options.uniform_average else p

    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext) -> dict[str, torch.Tensor]:
        """A (module doc): ``Ā``, ``B̄`` and ``W ← W + ΔW_res``; returns the global model's change
        ``s·Σ p_i B_iA_i − s·B̄_oldĀ_old`` per matrix (diagnostics)."""
        p = self.round_weights(uploads, weights)
        updates, means = {}, {}
        for m in self.targets:
            b_bar, a_bar, residual = fedex_residual([self.upload_pair(u, m) for u in uploads], p, self.scaling)
            updates[w_key(m)], means[m] = residual, (b_bar, a_bar)
        applied = self.apply_round_update(state, updates, delta=ctx.diagnostics)
        delta: dict[str, torch.Tensor] = {}
        for m, (b_bar, a_bar) in means.items():
            if ctx.diagnostics:
                old = lifted(state.params[b_key(m)], state.params[a_key(m)], self.scaling)
                delta[w_key(m)] = applied[w_key(m)] + lifted(b_bar, a_bar, self.scaling) - old
            state.params[a_key(m)], state.params[b_key(m)] = a_bar, b_bar
        self.average_heads(state, uploads, p)
        state.meta["weights"] = "uniform" if self.options.uniform_average else "round"
        return delta

    @torch.no_grad()
    def load_global(self, model: nn.Module, state: ServerState) -> None:
        for m in self.targets:
            self.assign(self.base_weight(model, m), state.params[w_key(m)])
            self.assign(self.lora_a(model, m), state.params[a_key(m)])
            self.assign(self.lora_b(model, m), state.params[b_key(m)])
        self.load_heads(model, {n: state.params[n] for n in self.heads})
