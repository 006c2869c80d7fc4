"""The local training loop shared by every method's operator T (paper Algorithm 3).

``local_train`` runs the client's local steps: forward, loss, backward, optional global-norm
gradient clipping (the paper's bounded-gradient assumption), optimizer step, with the learning
rate set every step from the paper's schedule (Appendix H: linear warmup then cosine decay).

Gradient accumulation (``train.grad_accum_steps = k``; Appendix H, Table 8: Llama-2-7B trains
with per-device batch 2 and 32 accumulation steps, an effective batch of 64). The data pipeline
yields micro-batches of ``train.batch_size``; every ``k`` of them make one optimizer step, whose
gradient is that of the mean loss over the step's *whole* batch,

    ∇L = Σ_j (n_j / N) ∇L_j,    N = Σ_j n_j,

where ``L_j`` is micro-batch ``j``'s mean loss and ``n_j`` the number of terms it averages over:
the task's ``loss_items(batch)`` when the task defines one (a causal LM's loss is a mean over
response tokens), else the micro-batch's rows (per-example means). So ``k`` micro-batches give
the gradient of one batch ``k`` times as large, to float rounding (without dropout). The last
step of a round may hold fewer than ``k`` micro-batches; it is weighted the same way. Steps,
the LR schedule (warmup, cosine), gradient clipping and the reported losses count *optimizer*
steps; ``ctx.on_step`` (progress) is called per micro-batch.

FedProx (Li et al. 2020, "Federated Optimization in Heterogeneous Networks", eq. (2);
``train.prox_mu = μ > 0``): the client minimises h_i(θ) = F_i(θ) + μ/2‖θ − θ_global‖² over its
trainable parameters, θ_global being their values as ``local_train`` starts (the broadcast the
method has just loaded). Once per optimizer step, after the micro-batches' backward passes and
before gradient clipping and the optimizer, μ(θ − θ_global) is added to each trainable
parameter's gradient — so the clipped gradient is that of h_i, and for FedGaLore the proximal
gradient enters *before* GaLore's projection (GaLoreAdamW projects ``p.grad``). Reported losses
are F_i's (without the proximal term). μ = 0 skips all of it (bit-identical to plain training).

SCAFFOLD (``train.scaffold``; ``ctx.scaffold``, :mod:`fedgalore.federated.scaffold`): after each
optimizer step every trainable parameter moves by −η_t (c − c_i).

A site with several devices (``train.devices_per_client = N > 1``): every step's batch is cut into
N row shards, trained by this process and N−1 helpers (:mod:`fedgalore.federated.data_parallel`),
each holding a replica, or with ``train.shard_params`` its FSDP2 shard of a copy of the model, which
this process trains instead and gathers back into ``model`` and ``optimizer`` at the round's end
(:mod:`fedgalore.federated.sharded_site`). Either way the update is this loop's on one process.

Record-level DP-SGD (``privacy.record``; ``ctx.privacy``, :class:`fedgalore.privacy.dpsgd.DPSGD`):
Opacus' per-example gradient hooks go on the model and its ``DPOptimizer`` around the method's
optimizer for the round. Each micro-batch backpropagates its own mean loss (Opacus recovers the
per-example gradients; an empty Poisson draw, ``{}``, is skipped), and before every optimizer step
``p.grad`` is replaced by the privatised gradient ``(Σ_i clip_C(g_i) + N(0, σ²C²)) / (q·n)`` — also
on a step whose draws were all empty (noise only). FedProx's term and SCAFFOLD's correction come
after it (they use no data); ``train.grad_clip`` does not apply (the per-example clip replaces it).
The optimizer then steps on the privatised gradient only. The returned stats add the site's
``dp_*`` numbers for the server's accountant.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from fedgalore.federated.step_end import _set_lr, end_of_step
from fedgalore.protocol.state import ClientContext

__all__ = ["lr_factor", "local_train", "ClientError", "optimizer_steps", "loss_items", "epoch_switch_step", "end_of_step"]


class ClientError(RuntimeError):
    """Local training failed (non-finite loss, exception); the engine drops the client."""


def lr_factor(step: int, total: int, warmup_ratio: float, schedule: str) -> float:
    """Multiplier of the peak LR at global step ``step`` of ``total`` (optimizer steps).

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


def optimizer_steps(micro_batches: int, grad_accum_steps: int) -> int:
    """Optimizer steps made from ``micro_batches`` micro-batches, ``grad_accum_steps`` per step
    (a last, partial group is a step of its own): ``⌈micro_batches / k⌉``."""
    k = max(int(grad_accum_steps), 1)
    return -(-int(micro_batches) // k)


def epoch_switch_step(num_examples: int, batch_size: int, grad_accum_steps: int, epochs: float, total_steps: int) -> int:
    """The first optimizer step of a round that lies after its first ``epochs`` local epochs,
    kept inside the round: ``min(⌈⌈epochs · n / b⌉ / k⌉, T − 1)`` (and ≥ 0).

    The round's examples are one stream of ``E`` shuffled passes over the client's ``n``
    examples, cut into micro-batches of ``b`` (``k`` per optimizer step, ``T`` steps in all;
    :func:`local_train`). Micro-batch ``i`` starts at example ``i·b``, so the first one that
    starts at or after example ``epochs · n`` is ``⌈epochs · n / b⌉``, and its optimizer step is
    that number over ``k``, rounded up. Used by FedGaLore's epoch schedule (paper §4
    "SVD-to-random projectors": data-driven projectors in early local epochs, the seeded one in
    later epochs). The cap at ``T − 1`` is our reading for a client whose epoch boundary falls
    inside its last step (n ≤ b / (E − 1) examples; a one-step round): its last step (a one-step
    round: its only step) runs in the later phase, so every client ends the round there."""
    if total_steps <= 0:
        return 0
    micro = math.ceil(max(float(epochs), 0.0) * int(num_examples) / max(int(batch_size), 1) - 1e-9)
    step = -(-max(micro, 0) // max(int(grad_accum_steps), 1))
    return max(0, min(step, int(total_steps) - 1))


def loss_items(loss_fn: Callable[..., Any], batch: dict[str, torch.Tensor]) -> int:
    """How many terms ``loss_fn``'s mean runs over for ``batch``: the task's ``loss_items(batch)``
    when the task that owns ``loss_fn`` defines one (e.g. response tokens of a causal LM), else the
    batch's rows."""
    counter = getattr(getattr(loss_fn, "__self__", None), "loss_items", None)
    if counter is not None:
        return int(counter(batch))
    first = next(iter(batch.values()), None)
    return int(first.shape[0]) if first is not None and first.dim() > 0 else 1


def local_train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    ctx: ClientContext,
    clip_params: Iterable[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Run this round's local steps on one client; returns loss statistics per optimizer step.

    The schedule scope is ``ctx.train.schedule_scope``: ``global`` places local step t of round
    k at global step k·T_nom + t of R·T_nom (one warmup+cosine over the whole federation, like
    the centralised reference); ``round`` restarts the schedule every round. ``T`` counts
    optimizer steps: ``⌈micro-batches / train.grad_accum_steps⌉`` (module doc).
    """
    tc = ctx.train
    k = max(int(tc.grad_accum_steps), 1)
    if tc.schedule_scope == "global":
        per_round = optimizer_steps(ctx.steps_per_round, k)
        offset, total = ctx.round * per_round, ctx.total_rounds * per_round
    else:
        offset, total = 0, optimizer_steps(ctx.steps, k)
    params = [p for p in (clip_params if clip_params is not None else model.parameters()) if p.requires_grad]
    mu = float(tc.prox_mu)
    anchor = [p.detach().clone() for p in params] if mu > 0.0 else None  # θ_global (FedProx)
    scaffold = ctx.scaffold
    if scaffold is not None:
        scaffold.begin()
    private = ctx.privacy  # DP-SGD (module doc): per-example clipping and noise
    if private is not None:
        private.attach(model, optimizer)
    model.train()
    losses: list[float] = []
    micro = 0
    batches = iter(ctx.batches())
    site = copy = None  # a site with several devices: ranks 1..N-1 (module doc of fedgalore.federated.data_parallel)
    n_dev = int(tc.devices_per_client)
    if n_dev > 1:
        if private is not None:
            raise ClientError(f"client {ctx.client}: train.devices_per_client={n_dev} cannot run record-level DP-SGD")
        from fedgalore.federated.data_parallel import site_workers

        shard = bool(tc.shard_params)
        if shard and scaffold is not None:
            raise ClientError(f"client {ctx.client}: train.shard_params=true cannot run SCAFFOLD")
        site = site_workers(n_dev, ctx.device, sharded=shard)
        copy = site.begin(model, optimizer, ctx.loss_fn, params, scaffold, mu, tc.grad_clip,
                          seed=(int(ctx.round_seed) * 1009 + int(ctx.client)) % (1 << 62))
        if copy is not None:  # sharded (fedgalore.federated.sharded_site): rank 0 trains its shard of a copy
            run_model, run_opt, run_params = copy.model, copy.optimizer, copy.params
            anchor = [p.detach().clone() for p in run_params] if mu > 0.0 else None
    if site is None or copy is None:
        run_model, run_opt, run_params = model, optimizer, params
    try:
        for t in itertools.count():
            group = list(itertools.islice(batches, k))
            if not group:
                break
            factor = lr_factor(offset + t, total, tc.warmup_ratio, tc.schedule)
            _set_lr(run_opt, factor)
            if site is not None:
                values, per, n_total = site.step(ctx.loss_fn, group, run_model, run_params, factor,
                                                 lambda b: loss_items(ctx.loss_fn, b))
                step_loss = 0.0
                for value, n in zip(values, per):
                    if n == 0:
                        micro += 1
                        continue
                    if not math.isfinite(value):
                        run_opt.zero_grad(set_to_none=True)
                        raise ClientError(f"client {ctx.client}: non-finite loss {value} at local step {t} (micro-batch {micro})")
                    step_loss += n / n_total * value
                    if ctx.on_step is not None:
                        ctx.on_step(micro, value)
                    micro += 1
                if n_total == 0:
                    continue
                end_of_step(run_opt, run_params, anchor, mu, tc.grad_clip, scaffold)
                losses.append(step_loss)
                continue
            micro = _one_process_step(model, optimizer, ctx, group, t, k, micro, losses, params, anchor, mu, scaffold, private)
        if site is not None:
            site.finish(model, optimizer)  # sharded: the gathered copy into the client's model and optimizer
    finally:
        if site is not None:
            site.end()
    model.eval()
    if private is not None:
        private.detach()
    if scaffold is not None and losses:
        scaffold.finish()
    if not losses:
        out = {"steps": 0, "loss_first": float("nan"), "loss_last": float("nan"), "loss_mean": float("nan")}
    else:
        out = {"steps": len(losses), "loss_first": losses[0], "loss_last": losses[-1], "loss_mean": sum(losses) / len(losses)}
        if k > 1:
            out["micro_batches"] = micro
    if private is not None:
        out.update(private.stats())
    return out


def _one_process_step(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: ClientContext, group: list, t: int, k: int,
                      micro: int, losses: list[float], params: list[torch.Tensor], anchor: list[torch.Tensor] | None,
                      mu: float, scaffold: Any, private: Any) -> int:
    """Local step ``t`` in this process: the micro-batches' forward and backward passes, then
    :func:`end_of_step`; appends the step's loss to ``losses`` and returns the micro-batch counter."""
    tc = ctx.train
    counts = [loss_items(ctx.loss_fn, b) if b else 0 for b in group] if k > 1 else [1]
    n_total = sum(counts)
    step_loss = 0.0
    for batch, n in zip(group, counts):
        if n == 0 or not batch:  # nothing to average over (no response token; an empty Poisson draw): no term
            micro += 1
            continue
        batch = {key: v.to(ctx.device) for key, v in batch.items()}
        loss = ctx.loss_fn(model, batch)
        value = float(loss.detach())
        if not math.isfinite(value):
            optimizer.zero_grad(set_to_none=True)
            raise ClientError(f"client {ctx.client}: non-finite loss {value} at local step {t} (micro-batch {micro})")
        weight = n / n_total
        # DP-SGD: each micro-batch's own mean (Opacus turns it into per-example gradients)
        (loss if weight == 1.0 or private is not None else loss * weight).backward()
        step_loss += weight * value
        if ctx.on_step is not None:
            ctx.on_step(micro, value)
        micro += 1
    if n_total == 0 and private is None:
        return micro
    if private is not None:
        private.privatise()  # p.grad <- the clipped, noised mean; the raw gradient never reaches the optimizer
    end_of_step(optimizer, params, anchor, mu, tc.grad_clip if private is None else None, scaffold, private)
    if private is None or any(group):  # (an all-empty DP step has no loss)
        losses.append(step_loss)
    return micro
