"""SCAFFOLD control variates (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning", Algorithm 1 with option II).

Client i starts from the global x, holds its control variate c_i and is sent the server's c. Each
local step corrects the gradient by c − c_i,

    y ← y − η (g_i(y) − c_i + c),                                   (Alg. 1, line 10)

and after its K local steps the client's control variate becomes (option II)

    c_i⁺ = c_i − c + (x − y) / (K η).                                (Alg. 1, line 12)

The server keeps c and, in simulation, every client's c_i (``ServerState.extras`` under
``scaffold/c/<param>`` and ``scaffold/ci/<client>/<param>``; checkpointed), and updates
c ← c + (1/N) Σ_{i∈S} (c_i⁺ − c_i) over the round's valid uploads (Alg. 1, line 17; N = all
clients). The model itself is aggregated by the method's A as usual.

What travels (and what the ledger counts): down, one extra tensor per trainable parameter,
``scaffold/corr/<param>`` = c − c_i (the client needs only the difference for its steps, and
c_i⁺ = (x − y)/(Kη) − (c − c_i)); up, one extra tensor per trainable parameter,
``scaffold/ci/<param>`` = c_i⁺. That is the size of SCAFFOLD's deployed messages (c down,
Δc_i up): each direction carries one extra copy of the trainable parameters. The downlink is
per client on every backend (sequential, Ray, Flower): the server holds the c_i in all of them.

With a learning-rate schedule the step size varies; K η becomes Σ_t η_t (the same identity: under
SGD, x − y = Σ_t η_t (g_t − c_i + c)). Under AdamW (FedAvg-Full, FedIT) the correction is applied
after each optimizer step as p ← p − η_t (c − c_i), decoupled from Adam's normalisation — the rule
OpenFedLLM's SCAFFOLD uses with its AdamW trainer (with the peak lr for η_t and Kη; here the
scheduled η_t and Σ_t η_t, equal under a constant schedule without warmup); under SGD without momentum and weight decay
(FFA-LoRA's default) it is exactly line 10.

Keys are the method's server parameter names (``Method.scaffold_params``); everything here works
on dicts of tensors.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from fedgalore.protocol.payload import Dense, Payload

__all__ = ["CORR", "NEW_CI", "ScaffoldClient", "split_entries", "server_c", "client_c", "correction", "update_controls"]

CORR = "scaffold/corr/"  # downlink entries: c − c_i
NEW_CI = "scaffold/ci/"  # uplink entries: c_i⁺
_C = "scaffold/c/"  # ServerState.extras: the server's c
_CI = "scaffold/ci/"  # ServerState.extras: scaffold/ci/<client>/<param>


def split_entries(payload: Payload, prefix: str) -> tuple[Payload, dict[str, torch.Tensor]]:
    """(the payload without ``prefix`` entries, those entries' tensors keyed by the rest of their name)."""
    rest = {k: e for k, e in payload.entries.items() if not k.startswith(prefix)}
    mine = {k[len(prefix):]: e.materialize() for k, e in payload.entries.items() if k.startswith(prefix)}
    return Payload(rest, dict(payload.meta)), mine


class ScaffoldClient:
    """The client side of one round: ``correction`` = c − c_i and the trainable parameters, both
    keyed by server parameter name. :func:`fedgalore.federated.client.local_train` calls
    :meth:`begin` (x = the parameters as the round starts), :meth:`after_step` after every
    optimizer step and :meth:`finish` (c_i⁺)."""

    def __init__(self, correction: Mapping[str, torch.Tensor], params: Mapping[str, nn.Parameter]) -> None:
        missing = sorted(set(params) - set(correction))
        if missing:
            raise ValueError(f"SCAFFOLD: no correction for {missing[:3]}")
        self.correction = dict(correction)
        self.params = dict(params)
        self.start: dict[str, torch.Tensor] = {}
        self.lr_sum: dict[str, float] = {}
        self.new_ci: dict[str, torch.Tensor] | None = None

    def begin(self) -> None:
        self.start = {k: p.detach().float().clone() for k, p in self.params.items()}
        self.lr_sum = {k: 0.0 for k in self.params}
        self.corr = {k: self.correction[k].to(p.device, p.dtype) for k, p in self.params.items()}

    @torch.no_grad()
    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """y ← y − η_t (c − c_i) for every trainable parameter, η_t its group's current lr."""
        lrs = {id(p[1] if isinstance(p, tuple) else p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}
        for k, p in self.params.items():
            lr = lrs.get(id(p), 0.0)
            p.add_(self.corr[k], alpha=-lr)
            self.lr_sum[k] += lr

    @torch.no_grad()
    def finish(self) -> dict[str, torch.Tensor]:
        """c_i⁺ = (x − y) / Σ_t η_t − (c − c_i) (option II)."""
        out = {}
        for k, p in self.params.items():
            s = self.lr_sum[k]
            if s <= 0.0:
                raise RuntimeError(f"SCAFFOLD needs at least one local step with a positive learning rate ({k})")
            out[k] = (self.start[k] - p.detach().float()) / s - self.corr[k].float()
        self.new_ci = {k: v.cpu() for k, v in out.items()}
        return self.new_ci

    def upload_entries(self) -> dict[str, Dense]:
        assert self.new_ci is not None, "finish() first"
        return {NEW_CI + k: Dense(v) for k, v in self.new_ci.items()}


# ----------------------------------------------------------------------------- server side
def server_c(extras: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The server's c (zeros before the first update), keyed like ``like``."""
    return {k: extras.get(_C + k, torch.zeros_like(v, dtype=torch.float32)) for k, v in like.items()}


def client_c(extras: Mapping[str, torch.Tensor], client: int, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Client ``client``'s c_i as the server keeps it (zeros before its first upload)."""
    return {k: extras.get(f"{_CI}{client}/{k}", torch.zeros_like(v, dtype=torch.float32)) for k, v in like.items()}


def correction(extras: Mapping[str, torch.Tensor], client: int, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """c − c_i for ``client`` (what its downlink carries)."""
    c, ci = server_c(extras, like), client_c(extras, client, like)
    return {k: c[k] - ci[k] for k in like}


@torch.no_grad()
def update_controls(extras: dict[str, torch.Tensor], new: Mapping[int, Mapping[str, torch.Tensor]],
                    like: Mapping[str, torch.Tensor], num_clients: int) -> None:
    """Store each uploading client's c_i⁺ and move c by (1/N) Σ_i (c_i⁺ − c_i) (Alg. 1, line 17)."""
    c = server_c(extras, like)
    total = {k: torch.zeros_like(v) for k, v in c.items()}
    for client in sorted(new):
        old = client_c(extras, client, like)
        for k in like:
            ci_new = new[client][k].float()
            total[k] += ci_new - old[k]
            extras[f"{_CI}{client}/{k}"] = ci_new.clone()
    for k in like:
        extras[_C + k] = c[k] + total[k] / float(num_clients)
