"""FedAvg-Full: full fine-tuning of the target matrices (+ head) with AdamW, FedAvg of deltas.

T: AdamW (fresh each round) on every adapted weight matrix W and the head; the client uploads
the dense deltas ΔW_i = W_i^T − W̄_k. A: θ̄_{k+1} = θ̄_k + Σ_i p_i Δ_i (paper §3, "Server
Aggregation Operator", FedAvg). S: none. This is the paper's FFT baseline; for Llama it is the
"full weight matrices of the target modules" variant (paper §6 footnote).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from fedgalore.federated.client import local_train
from fedgalore.federated.payload import Dense, Payload
from fedgalore.methods.base import (
    ClientContext,
    Method,
    RoundContext,
    ServerState,
    load_params,
    named_params,
    register,
)


def _freeze_all_but(model: nn.Module, names: Sequence[str]) -> None:
    model.requires_grad_(False)
    for p in named_params(model, names).values():
        p.requires_grad_(True)


def weighted_sum(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Σ_i p_i X_i in fp32."""
    out = torch.zeros_like(tensors[0], dtype=torch.float32)
    for t, w in zip(tensors, weights):
        out.add_(t.float(), alpha=float(w))
    return out


class DenseTargetsMethod(Method):
    """Shared by methods whose client trains the adapted matrices W themselves (+ head) and whose
    server holds them densely: FedAvg-Full and the FedGaLore family."""

    def setup(self, model, target_modules, head_params):
        self.targets = [m + ".weight" for m in target_modules]
        self.heads = list(head_params)
        _freeze_all_but(model, self.targets + self.heads)
        return model

    def init_server_state(self, model):
        params = named_params(model, self.targets + self.heads)
        return ServerState(params={n: p.detach().float().clone() for n, p in params.items()})

    def average_heads(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float]) -> None:
        """Head: θ ← θ + Σ_i p_i Δθ_i."""
        for n in self.heads:
            state.params[n] += weighted_sum([u[n].materialize() for u in uploads], weights)

    def load_global(self, model, state):
        load_params(model, state.params)


@register
class FedAvgFull(DenseTargetsMethod):
    name = "fedavg_full"
    summary = "full fine-tuning of target matrices + head with AdamW; FedAvg of dense deltas"

    def client_update(self, model: nn.Module, broadcast: Payload, ctx: ClientContext) -> Payload:
        start = {n: broadcast[n].materialize() for n in self.targets + self.heads}
        load_params(model, start)
        params = named_params(model, self.targets + self.heads)
        tc = ctx.train
        groups = [{"params": [params[n] for n in self.targets], "lr": tc.lr}]
        if self.heads:
            groups.append({"params": [params[n] for n in self.heads], "lr": tc.head_lr or tc.lr})
        opt = torch.optim.AdamW(groups, lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay)
        stats = local_train(model, opt, ctx, params.values())
        entries = {n: Dense((params[n].detach().float() - start[n].float())) for n in self.targets + self.heads}
        return Payload(entries, {"num_examples": ctx.num_examples, **stats})

    def aggregate(self, state: ServerState, uploads: Sequence[Payload], weights: Sequence[float], ctx: RoundContext):
        applied = {}
        for n in self.targets:
            applied[n] = weighted_sum([u[n].materialize() for u in uploads], weights)
            state.params[n] += applied[n]
        self.average_heads(state, uploads, weights)
        return applied

    def client_deltas(self, state, upload):
        return {n: upload[n].materialize().float() for n in self.targets}

    def scale_upload(self, upload, factor):
        return Payload({k: Dense(e.tensor * factor) for k, e in upload.entries.items()}, dict(upload.meta))
