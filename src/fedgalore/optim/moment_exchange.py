"""What a GaLore matrix's second moment sends and receives (paper Alg. 1 lines 3, 10 and 14; App. B
"buffer reprojection"; DESIGN §3.1): the upload ``ṽ`` and the warm start from the synchronised ``v̄``.

The rules of the moment and its evidence are stated once in :mod:`fedgalore.protocol.second_moment`;
these functions apply them to one matrix's typed state (:class:`~fedgalore.optim.state.GaLoreParamState`:
``exp_avg_sq``, ``v_weight``, ``basis``, ``basis_seed``, the pending ``warm`` start and the
diagnostics ``warm_diag`` / ``upload_kept``). :mod:`fedgalore.optim.client_protocol` calls them from
``export_moments`` and ``load_second_moment``, :mod:`fedgalore.optim.functional` from the refresh
that first picks a basis.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from fedgalore.optim.state import GaLoreParamState
from fedgalore.protocol import second_moment as sm
from fedgalore.optim.schedule import frame_for
from fedgalore.protocol.bases import change_of_basis, frame_of, seeded_basis
from fedgalore.protocol.payload import MomentView

__all__ = ["v_weight", "export_view", "check_view", "apply_warm", "rescale_warm", "transfer"]


def v_weight(state: GaLoreParamState, side: str, b2: float) -> torch.Tensor:
    """Prior weight ``c`` of each projected coordinate, shaped to broadcast against ``V``: the
    stored evidence under ``bias_correction="weight"``, else ``1 − β₂^s`` on every coordinate."""
    if state.v_weight is not None:
        return state.v_weight
    v = state.exp_avg_sq
    d = v.shape[1] if side == "right" else v.shape[0]
    shape = (1, d) if side == "right" else (d, 1)
    value = 1.0 - b2 ** state.v_step if state.v_step > 0 else 0.0
    return torch.full(shape, value, dtype=torch.float32, device=v.device)


def export_view(state: GaLoreParamState, group: dict[str, Any], side: str, shape: tuple[int, int], basis: torch.Tensor,
                target: Optional[int], buffer: bool) -> MomentView:
    """One matrix's upload ``ṽ`` (Alg. 1 line 10) as a :class:`MomentView`.

    ``buffer=False``: the estimate ``V / c`` with its evidence ``c``; ``buffer=True``: the raw
    buffer ``V`` without evidence (Algorithm 1 as written). ``target`` (a seed) expresses it in the
    seeded basis ``R = seeded_basis(target, …)``: unless the current basis already is ``R``, ``V``
    (and ``c``) move there by the group's ``moment_transfer`` (``C = P Rᵀ``,
    :func:`fedgalore.protocol.second_moment.move`), and the view carries the seed only. The share of
    ``‖V‖_F`` the move keeps is left in ``state.upload_kept`` (1 when no move was needed)."""
    per_coordinate = state.v_weight is not None
    frame = frame_for(group, shape[0], shape[1], side)
    v, w = state.exp_avg_sq, v_weight(state, side, group["betas"][1])
    seed: Optional[int] = int(state.basis_seed) if state.basis_seed >= 0 else None
    out_basis: Optional[torch.Tensor] = None if seed is not None else basis
    kept = 1.0
    if target is not None and target != seed:
        rank = v.shape[1] if side == "right" else v.shape[0]
        new = seeded_basis(int(target), shape[0], shape[1], rank, side, frame).to(v.device)
        before = float(v.norm())
        v, w = sm.move(v, w, change_of_basis(basis, new, side), side, group["moment_transfer"], per_coordinate)
        kept = float(v.norm()) / before if before > 0 else 1.0
        seed, out_basis = int(target), None
    state.upload_kept = kept
    moment, weight = (v, None) if buffer else (sm.estimate(v, w), w.detach().flatten().float().cpu().clone())
    rank = moment.shape[1] if side == "right" else moment.shape[0]
    return MomentView(moment.detach().float().cpu().clone(), side, shape,
                      None if out_basis is None else out_basis.detach().float().cpu().clone(), seed, weight,
                      frame_of(rank, frame) if seed is not None else None)


def check_view(name: str, view: Any, side: str, shape: tuple[int, int], device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A synchronised state for parameter ``name`` checked against the matrix (side, shape, rank,
    finite values, non-negative weights); returns its coordinates, basis and weights as fp32 on
    ``device``. Every problem is one ``ValueError`` / ``TypeError`` / ``FloatingPointError`` naming it."""
    if not isinstance(view, MomentView):
        raise TypeError(f"load_second_moment({name!r}): expected a MomentView, got {type(view).__name__}")
    m, n = shape
    x = view.moment
    if view.side != side or tuple(view.shape) != (m, n):
        raise ValueError(
            f"load_second_moment({name!r}): a {view.side}-side view of a {tuple(view.shape)} matrix does not fit "
            f"this {side}-side {m}x{n} parameter"
        )
    if x.dim() != 2 or (side == "right" and x.shape[0] != m) or (side == "left" and x.shape[1] != n):
        raise ValueError(f"load_second_moment({name!r}): moment of shape {tuple(x.shape)} does not fit a {m}x{n} {side}-side view")
    r = view.rank
    basis = view.basis_matrix()
    if tuple(basis.shape) != ((r, n) if side == "right" else (m, r)):
        raise ValueError(f"load_second_moment({name!r}): basis {tuple(basis.shape)} does not match rank {r}")
    weight = view.weight
    if weight is not None and tuple(weight.shape) != (r,):
        raise ValueError(f"load_second_moment({name!r}): weight must have shape ({r},), got {tuple(weight.shape)}")
    tensors = [t.detach().to(device=device, dtype=torch.float32) for t in (x, basis)]
    prior_weight = None if weight is None else weight.detach().to(device=device, dtype=torch.float32)
    if not all(bool(torch.isfinite(t).all()) for t in tensors + ([prior_weight] if prior_weight is not None else [])):
        raise FloatingPointError(f"load_second_moment({name!r}): non-finite values")
    if prior_weight is not None and bool((prior_weight < 0).any()):
        raise ValueError(f"load_second_moment({name!r}): negative prior weights")
    return tensors[0], tensors[1], prior_weight


def apply_warm(state: GaLoreParamState, group: dict[str, Any], side: str, new: torch.Tensor) -> None:
    """Start ``V`` from the pending synchronised state, for the basis ``new`` now in use.

    ``x`` holds the coordinates of ``v̄`` on basis ``b``, ``c`` their evidence;
    ``C = change_of_basis(b, new)``. ``bias_correction="steps"`` (Algorithm 1 line 3 as
    written): ``V = max(x C, 0)`` (:func:`fedgalore.protocol.second_moment.warm_paper`), and
    the bias correction keeps counting this optimizer's steps. ``"weight"``: ``V = max(x, 0)∘c``
    with evidence ``c``, both moved to ``new`` by ``moment_transfer`` exactly as an in-round
    refresh (:func:`~fedgalore.protocol.second_moment.warm_aligned`; ``C = I`` when ``new`` is
    ``b``: the lift is inverted exactly).
    """
    x, b, c = state.warm.moment, state.warm.basis, state.warm.weight
    state.warm = None
    cb = change_of_basis(b, new, side)
    diag: dict[str, float] = {}
    if group["bias_correction"] == "steps":
        diag["warm_clamped"] = float((sm.apply_change(x, cb, side) < 0).float().mean())
        state.exp_avg_sq = sm.warm_paper(x, cb, side).contiguous()
        before = float(x.norm())
    else:
        diag["warm_clamped"] = float((x < 0).float().mean())
        v, w = sm.warm_aligned(x, c, cb, side, group["moment_transfer"])
        d = x.shape[1] if side == "right" else x.shape[0]
        ev = sm.as_evidence(c, side, d, x)
        total = float(ev.sum())
        diag["prior_retained"] = float(w.sum()) / total if total > 0 else 0.0
        state.exp_avg_sq = v.contiguous()
        state.v_weight = w.contiguous()
        before = float((x.clamp(min=0.0) * ev).norm())
    # share of the synchronised buffer's norm (‖v̄‖_F, aligned: of c̄∘v̄) the move onto the first basis keeps
    diag["warm_kept"] = float(state.exp_avg_sq.norm()) / before if before > 0 else 1.0
    state.warm_diag = diag
    if group["warm_scale"] == "gradient":
        state.warm_rescale = True  # at the next step's projected gradient (rescale_warm)


def rescale_warm(v: torch.Tensor, c: Optional[torch.Tensor], r: torch.Tensor, state: GaLoreParamState) -> None:
    """``warm_scale="gradient"``: the warm prior's estimate ``V/c`` keeps its shape and takes the
    client's own scale, ``V ← V · mean(R∘R) / mean(V/c)`` with ``R`` this (the round's first)
    projected gradient — a prior that carries no gradient units (FedGaLore's ``sync: aggregate``:
    the squared aggregated update, normalised) becomes one in them. A zero prior or a zero
    gradient leaves ``V`` as it is; ``warm_diag["warm_rescale"]`` records the factor."""
    est = v if c is None else v / c.clamp(min=torch.finfo(v.dtype).tiny)
    mean_est, mean_r2 = float(est.mean()), float((r * r).mean())
    factor = mean_r2 / mean_est if mean_est > 0 and mean_r2 > 0 and math.isfinite(mean_r2 / mean_est) else 1.0
    if factor != 1.0:
        v.mul_(factor)
    if state.warm_diag is None:
        state.warm_diag = {}
    state.warm_diag["warm_rescale"] = factor


def transfer(state: GaLoreParamState, group: dict[str, Any], side: str, c: torch.Tensor) -> None:
    """Move the moments to new coordinates (``C`` from :func:`fedgalore.protocol.bases.change_of_basis`, at a refresh): ``M <- M C``
    and the second moment by the group's ``moment_transfer``
    (:func:`fedgalore.protocol.second_moment.move`) — with its per-coordinate evidence under
    ``bias_correction="weight"``; the shadow cold moment is corrected by steps and moves like
    an uncorrected ``V``."""
    mt = group["moment_transfer"]
    state.exp_avg = sm.apply_change(state.exp_avg, c, side)
    if state.v_weight is not None:
        state.exp_avg_sq, state.v_weight = sm.move(state.exp_avg_sq, state.v_weight, c, side, mt)
    else:
        state.exp_avg_sq = sm.move(state.exp_avg_sq, c.new_ones(()), c, side, mt, per_coordinate=False)[0]
    if state.cold_v is not None:
        state.cold_v = sm.move(state.cold_v, c.new_ones(()), c, side, mt, per_coordinate=False)[0]
    if mt == "reset":
        state.v_step = 0
        if state.cold_v is not None:
            state.cold_step = 0
