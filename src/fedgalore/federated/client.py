"""The local training loop shared by every method's operator T (paper Algorithm 3).

``local_train`` runs the client's local steps: forward, loss, backward, optional global-norm
gradient clipping (the paper's bounded-gradient assumption), optimizer step, with the learning
rate set every step from the paper's schedule (Appendix H: linear warmup then cosine decay).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

if TYPE_CHECKING:  # methods import this module; keep the dependency one-way at run time
    from fedgalore.methods.base import ClientContext

__all__ = ["lr_factor", "local_train", "ClientError"]


class ClientError(RuntimeError):
    """Local training failed (non-finite loss, exception); the engine drops the client."""


def lr_factor(step: int, total: int, warmup_ratio: float, schedule: str) -> float:
    """Multiplier of the peak LR at global step ``step`` of ``total``.

    η_t = η · t/W for t < W (W = ⌈warmup_ratio · total⌉), then
    cosine: η · ½(1 + cos(π (t−W)/(total−W))); linear: η · (total−t)/(total−W); constant: η.
    """
    total = max(int(total), 1)
    warm = int(math.ceil(warmup_ratio * total))
    if step < warm:
        return (step + 1) / (warm + 1)
    if schedule == "constant":
        return 1.0
    progress = min(max(step - warm, 0) / max(total - warm, 1), 1.0)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _set_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    for g in optimizer.param_groups:
        g.setdefault("initial_lr", g["lr"])
        g["lr"] = g["initial_lr"] * factor


def local_train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: ClientContext,
    clip_params: Iterable[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Run this round's local steps on one client; returns loss statistics.

    The schedule scope is ``ctx.train.schedule_scope``: ``global`` places local step t of round
    k at global step k·T_nom + t of R·T_nom (one warmup+cosine over the whole federation, like
    the centralised reference); ``round`` restarts the schedule every round.
    """
    tc = ctx.train
    if tc.schedule_scope == "global":
        offset, total = ctx.round * ctx.steps_per_round, ctx.total_rounds * ctx.steps_per_round
    else:
        offset, total = 0, ctx.steps
    params = [p for p in (clip_params if clip_params is not None else model.parameters()) if p.requires_grad]
    model.train()
    losses: list[float] = []
    for t, batch in enumerate(ctx.batches()):
        _set_lr(optimizer, lr_factor(offset + t, total, tc.warmup_ratio, tc.schedule))
        batch = {k: v.to(ctx.device) for k, v in batch.items()}
        loss = ctx.loss_fn(model, batch)
        value = float(loss.detach())
        if not math.isfinite(value):
            optimizer.zero_grad(set_to_none=True)
            raise ClientError(f"client {ctx.client}: non-finite loss {value} at local step {t}")
        loss.backward()
        if tc.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(value)
        if ctx.on_step is not None:
            ctx.on_step(t, value)
    model.eval()
    if not losses:
        return {"steps": 0, "loss_first": float("nan"), "loss_last": float("nan"), "loss_mean": float("nan")}
    return {"steps": len(losses), "loss_first": losses[0], "loss_last": losses[-1], "loss_mean": sum(losses) / len(losses)}
