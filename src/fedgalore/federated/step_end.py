"""The end of a local optimizer step, shared by the client's loop (:mod:`fedgalore.federated.client`)
and the other ranks of a site with several devices (:mod:`fedgalore.federated.data_parallel`): the
learning rate of a step, FedProx's term, clipping, the optimizer, SCAFFOLD's correction."""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["end_of_step"]


@torch.no_grad()
def _add_prox_grad(params: list[torch.Tensor], anchor: list[torch.Tensor], mu: float) -> None:
    """∇ of μ/2‖θ − θ_global‖², i.e. μ(θ − θ_global), added to every trainable parameter's gradient (FedProx)."""
    for p, a in zip(params, anchor):
        prox = (p.detach() - a) * mu
        if p.grad is None:
            p.grad = prox.to(p.dtype)
        else:
            p.grad.add_(prox.to(p.grad.dtype))


def end_of_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], anchor: list[torch.Tensor] | None,
                mu: float, grad_clip: float | None, scaffold: Any, zero: Any = None) -> None:
    """Once the step's gradient is in ``p.grad``: FedProx's term, global-norm clipping, the optimizer
    step, zeroing the gradients (through ``zero``: DP-SGD's wrapper), SCAFFOLD's correction — the
    order of fedgalore.federated.client's module doc. Every rank of a site with several devices runs it too
    (:mod:`fedgalore.federated.data_parallel`)."""
    if anchor is not None:
        _add_prox_grad(params, anchor, mu)
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    (zero if zero is not None else optimizer).zero_grad(set_to_none=True)
    if scaffold is not None:
        scaffold.after_step(optimizer)


def _set_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    for g in optimizer.param_groups:
        g.setdefault("initial_lr", g["lr"])
        g["lr"] = g["initial_lr"] * factor
