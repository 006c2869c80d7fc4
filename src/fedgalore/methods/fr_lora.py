"""FR-LoRA (Yan et al., ICLR 2025, "Federated Residual Low-Rank Adaption"): residual base + fixed
PiSSA-style adapters that are reset every round.

Init (once, from the pretrained ``W0`` of each adapted matrix, fp32): thin SVD
``W0 = U S Vᵀ`` with a deterministic sign convention (the largest-magnitude entry of every left
singular vector is positive, so every process gets the same factors);
``B0 = U_r √(S_r/s)``, ``A0 = √(S_r/s) V_rᵀ``, so ``s·B0A0`` is the rank-r principal part of
``W0``; the frozen base becomes the residual ``W_res = W0 − s·B0A0`` and the initial model is
unchanged. (If ``r > min(m, n)`` the extra components are zero.)

T  every round each client starts from ``(A0, B0)`` on the current global residual base and
   trains with AdamW (fresh each round): ``B`` and the head, with ``A`` frozen — option
   ``freeze_a: true`` (default), as in the reference code (``trainer.py`` sets
   ``lora_A.requires_grad = False``, also for its FedAvg baseline); ``freeze_a: false`` trains
   both factors as the paper's text implies. The adapters get no weight decay by default
   (option ``adapter_weight_decay``, default 0.0; the reference uses 0 everywhere, and a
   decoupled decay of ``B`` would erode the principal part ``s·B0A0`` that the adapter carries);
   the head uses ``train.weight_decay``.
A  ``Ā = Σ p_i A_i`` (= ``A0`` when frozen), ``B̄ = Σ p_i B_i``, ``ΔW̄ = s(B̄Ā − B0A0)``,
   ``W_res ← W_res + ΔW̄``; head averaged; adapters reset to ``(A0, B0)``. Weights ``p_i`` are
   size-weighted by default; ``uniform_average: true`` reproduces the reference code, which
   overwrites the sample counts with ones (uniform mean of every key, head included). With A
   frozen, ``ΔW̄ = Σ p_i s(B_i − B0)A0`` is the exact average of the client deltas.
S  none.

Communication: down the current residual base per adapted matrix + head (``A0, B0`` are a
deterministic function of the pretrained weights, rebuilt by every process, so they never travel
as state). Option ``downlink`` (default ``auto`` → ``factored``; fedgalore.methods.downlink_mixin):
a client that holds ``W_res`` of version ``h`` gets each round's update since ``h`` as factors —
``(s(B̄ − B0), A0)``, rank r, when A is frozen (A0 travels inside the factors: not exploited),
``([sB̄, −sB0], [Ā; A0])``, rank 2r, otherwise — or, per matrix, the dense ``W_res`` when that
chain is gone or larger; ``downlink: dense`` sends ``Dense(W_res)`` (fp32) every round; up ``Dense(B_i)`` + head when ``A`` is frozen (an unchanged ``A0`` is not
information; the reference's state dict also carries it), ``LowRank(B_i, A_i)`` + head otherwise.
Differences from the reference left as documented choices: clients are stateless (the reference
keeps each client's AdamW state across rounds), and the LR schedule is the shared one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from torch import nn

from fedgalore.federated.robust import factored_term
from fedgalore.methods.base import option, register
from fedgalore.methods.traits import MethodTraits
from fedgalore.methods.downlink_mixin import DOWNLINK_HELP, FactoredDownlink
from fedgalore.protocol.payload import Dense, LowRank, Payload
from fedgalore.protocol.state import ClientContext, RoundContext, ServerState
from fedgalore.methods.lora_common import (
    LoraMethod,
    LoraOptions,
    a_key,
    b_key,
    check_weights,
    lifted,
    weighted_sum,
    w_key,
)

__all__ = ["FRLoRA", "pissa_factors"]


def pissa_factors(w0: torch.Tensor, rank: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B0, A0)`` with ``s·B0A0`` the rank-``rank`` principal part of ``w0`` (fp32, sign-fixed)."""
    w = w0.detach().float().cpu()
    u, sv, vh = torch.linalg.svd(w, full_matrices=False)
    k = min(rank, sv.numel())
    u, sv, vh = u[:, :k], sv[:k], vh[:k]
    idx = u.abs().argmax(dim=0)
    sign = torch.sign(u[idx, torch.arange(k)])
    sign[sign == 0] = 1.0
    u, vh = u * sign, vh * sign[:, None]
    root = torch.sqrt(sv / scaling)
    b0 = torch.zeros(w.shape[0], rank)
    a0 = torch.zeros(rank, w.shape[1])
    b0[:, :k] = u * root
    a0[:k] = root[:, None] * vh
    return b0, a0


@dataclass(frozen=True)
class FRLoRAOptions(LoraOptions):
    freeze_a: bool = option(True, "A stays at A0 on the clients (the reference code); false trains both factors")
    uniform_average: bool = option(False, "uniform mean of the uploads (the reference code) instead of size-weighted")
    adapter_weight_decay: float = option(0.0, "AdamW weight decay of the adapters (the head uses train.weight_decay)")
    downlink: Literal["auto", "dense", "factored"] = option("auto", DOWNLINK_HELP)


@register
class FRLoRA(FactoredDownlink, LoraMethod):
    name = "fr_lora"
    summary = "PiSSA-init LoRA (A frozen) + head with AdamW; server adds s(B̄Ā − B0A0) to the residual base, resets adapters"
    #: A averages the uploaded factors and heads (client-level DP: noise on their sum); W moves by rank ≤ 2r a round
    traits = MethodTraits(downlink="factored", optimizer="adamw", dp_aggregate="mean", exact_low_rank=True)
    options_class = FRLoRAOptions

    def __init__(self, rank: int = 8, options: FRLoRAOptions | None = None) -> None:
        super().__init__(rank, options)
        self.freeze_a = self.options.freeze_a
        self.uniform_average = self.options.uniform_average
        self.init_factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def train_a(self) -> bool:
        return not self.freeze_a

    def adapter_weight_decay(self, ctx: ClientContext) -> float:
        return float(self.options.adapter_weight_decay)

    @torch.no_grad()
    def prepare(self, model: nn.Module) -> None:
        """PiSSA init: adapters ← (A0, B0), base ← W0 − s·B0A0."""
        self.init_factors = {}
        for m in self.targets:
            w = self.base_weight(model, m)
            b0, a0 = pissa_factors(w, self.rank, self.scaling)
            self.init_factors[m] = (b0, a0)
            self.assign(w, w.detach().float().cpu() - lifted(b0, a0, self.scaling))
            self.assign(self.lora_a(model, m), a0)
            self.assign(self.lora_b(model, m), b0)

    def init_server_state(self, model: nn.Module) -> ServerState:
        params = {w_key(m): self.base_weight(model, m).detach().float().cpu().clone() for m in self.targets}
        params.update(self.server_heads(model))
        extras: dict[str, torch.Tensor] = {}
        for m, (b0, a0) in self.init_factors.items():
            extras[a_key(m)], extras[b_key(m)] = a0.clone(), b0.clone()
        return ServerState(params=params, extras=extras, meta={"scaling": self.scaling})

    def broadcast(self, state: ServerState, ctx: RoundContext) -> Payload:
        msg = self.broadcast_merged(state, ctx)
        msg.meta.update(self.downlink_meta(state))
        return msg

    def downlink_names(self) -> list[str]:
        return [w_key(m) for m in self.targets]

    def downlink_base(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return self.merged_downlink_base(model)  # the residual base W0 − s·B0A0 (prepared at setup)

    @torch.no_grad()
    def load_broadcast(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> None:
        self.load_merged(model, broadcast, self.start_matrices(broadcast, ctx.state))
        self.reset_adapters(model)

    @torch.no_grad()
    def reset_adapters(self, model: nn.Module) -> None:
        for m, (b0, a0) in self.init_factors.items():
            self.assign(self.lora_a(model, m), a0)
            self.assign(self.lora_b(model, m), b0)

    @torch.no_grad()
    def upload_entries(self, model: nn.Module) -> dict[str, Any]:
        if self.freeze_a:
            entries: dict[str, Any] = {b_key(m): Dense(self.lora_b(model, m).detach().cpu().clone()) for m in self.targets}
        else:
            entries = self.pair_entries(model)
        entries.update(self.head_entries(self.head_state(model)))
        return entries

    def client_factors(self, state: ServerState, upload: Payload, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B_i, A_i) of one upload; ``A_i = A0`` when A is frozen (not sent)."""
        if self.freeze_a:
            return self.upload_tensor(upload, b_key(module)), state.extras[a_key(module)]
        return self.upload_pair(upload, module)

    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext) -> dict[str, torch.Tensor]:
        """A: ``ΔW̄ = s(B̄Ā − B0A0)``, ``W_res ← W_res + ΔW̄`` (adapters reset to (A0, B0)). The
        update is kept factored and applied as a client of the factored downlink applies it:
        ``(s(B̄ − B0), A0)`` (rank r) when A is frozen, ``([sB̄, −sB0], [Ā; A0])`` (rank 2r) otherwise."""
        p = check_weights(uploads, weights)
        if self.uniform_average:
            p = [1.0 / len(uploads)] * len(uploads)
        updates = {}
        for m in self.targets:
            pairs = [self.client_factors(state, u, m) for u in uploads]
            b_bar = weighted_sum([b for b, _ in pairs], p)
            b0, a0 = state.extras[b_key(m)].float(), state.extras[a_key(m)].float()
            if self.freeze_a:
                updates[w_key(m)] = LowRank(self.scaling * (b_bar - b0), a0.clone())
            else:
                a_bar = weighted_sum([a for _, a in pairs], p)
                updates[w_key(m)] = LowRank(torch.cat([self.scaling * b_bar, -self.scaling * b0], dim=1), torch.cat([a_bar, a0], dim=0))
        delta = self.apply_round_update(state, updates, delta=ctx.diagnostics)
        self.average_heads(state, uploads, p)
        state.meta["weights"] = "uniform" if self.uniform_average else "size"
        return delta

    def client_deltas(self, state: ServerState, upload: Payload) -> dict[str, torch.Tensor]:
        """``s(B_iA_i − B0A0)``."""
        return {
            w_key(m): lifted(*self.client_factors(state, upload, m), self.scaling)
            - lifted(state.extras[b_key(m)], state.extras[a_key(m)], self.scaling)
            for m in self.targets
        }

    def update_terms(self, state: ServerState, upload: Payload) -> dict[str, list]:
        """``s(B_iA_i − B0A0)`` as two factored terms (federation.robust)."""
        out = {}
        for m in self.targets:
            b, a = self.client_factors(state, upload, m)
            out[w_key(m)] = [factored_term(self.scaling * b.float(), a.float()),
                             factored_term(-self.scaling * state.extras[b_key(m)].float(), state.extras[a_key(m)].float())]
        return out

    @classmethod
    def secure_aggregation_problem(cls, options) -> str | None:
        """Size-weighted FR-LoRA is a weighted sum of the uploads; ``uniform_average`` weighs every
        upload 1/K whatever the weights SecAgg+ sums with."""
        if options.uniform_average:
            return ("federation.secure_aggregation sums the uploads with each client's example count, and "
                    "method.options.uniform_average=true weighs them 1/K; set method.options.uniform_average: false")
        return super().secure_aggregation_problem(options)

    @torch.no_grad()
    def load_global(self, model: nn.Module, state: ServerState) -> None:
        for m in self.targets:
            self.assign(self.base_weight(model, m), state.params[w_key(m)])
            self.assign(self.lora_a(model, m), state.extras[a_key(m)])
            self.assign(self.lora_b(model, m), state.extras[b_key(m)])
        self.load_heads(model, {n: state.params[n] for n in self.heads})

