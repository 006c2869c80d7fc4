"""The client's side of FedGaLore's protocol on a :class:`~fedgalore.optim.galore_adamw.GaLoreAdamW`
(paper Alg. 1 lines 3, 10 and 13-14, §5; DESIGN §3.1): what a round reads from and writes into the
optimizer's typed state (:mod:`fedgalore.optim.state`) — the exact update record (:func:`mark`,
:func:`export_update`), the projected state (:func:`export_state`), the round's view basis
(:func:`view_seed`), the second moment's upload and warm start (:func:`export_moments`,
:func:`load_second_moment`) and the diagnostics (:func:`moment_diagnostics`,
:func:`update_ratio_summary`). The optimizer itself only steps (``torch.optim`` style); these
functions are what :mod:`fedgalore.methods.fedgalore` and the benchmarks call between steps.

On sharded parameters (FSDP2; :mod:`fedgalore.optim.sharded`) the exports gather the sharded
tensors, once, into the whole record / moment every rank returns (every rank calls them for the
same parameters in the same order); a warm start takes the whole ``v̄`` and keeps each rank's rows
(columns).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

import fedgalore.optim.functional as F
import fedgalore.optim.moment_exchange as moment_exchange
import fedgalore.optim.schedule as schedule
import fedgalore.optim.step_diagnostics as step_diagnostics
import fedgalore.optim.update_record as update_record
from fedgalore.optim.state import GaLoreParamState, RecordTerm, WarmStart
from fedgalore.protocol.bases import seeded_basis
from fedgalore.protocol.payload import GaLoreUpdate, MomentView

__all__ = ["GaLoreStateEntry", "rebuild_delta", "mark", "export_update", "export_state", "view_seed", "export_moments",
           "load_second_moment", "moment_diagnostics", "update_ratio_summary"]


@dataclass(frozen=True)
class GaLoreStateEntry:
    """Exported optimizer state of one GaLore parameter (:func:`export_state`).

    ``exp_avg_sq`` is the projected second moment ``v`` ((m x r) right / (r x n) left); its
    full-space matrix view is ``V = v P`` (right) or ``P v`` (left) (paper eq. "matrix view").
    ``basis`` is always the current basis matrix (``None`` before the first refresh); ``seed``
    and ``refresh_index`` identify it when it is seeded (``seed is None`` for data-driven bases).
    """

    name: str
    shape: tuple[int, int]
    side: str
    rank: int
    step: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    basis: Optional[torch.Tensor]
    seed: Optional[int]
    refresh_index: Optional[int]
    projection_seed: int
    warm: bool
    v_weight: torch.Tensor  # (r,): prior weight c of each projected coordinate (see bias_correction)


def rebuild_delta(update: GaLoreUpdate, w0: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense ``ΔW = decay · W0 + Σ_q term_q`` from an exact update record (paper §5; DESIGN §3.1).

    ``term_q = C_q P_q`` (right) or ``P_q C_q`` (left), with ``P_q`` rebuilt from its seed for
    seeded terms. ``w0`` is needed when weight decay was on (``decay != 0``). Returns fp32 CPU.
    """
    return update.materialize(None if w0 is None else w0.detach().cpu())


def _items(opt: Any) -> Iterable[tuple[str, torch.Tensor, dict[str, Any], GaLoreParamState]]:
    """Every GaLore parameter of ``opt`` with its name, group and state (created if new)."""
    for name, p, group in opt.galore_params():
        yield name, p, group, opt.param_state(p, group)


def _param(opt: Any, name: str) -> tuple[torch.Tensor, dict[str, Any]]:
    p = opt.param_by_name(name)
    return p, next(g for g in opt.param_groups if any(q is p for q in g["params"]))


def _shape(p: torch.Tensor) -> tuple[int, int]:
    return int(p.shape[0]), int(p.shape[1])


def mark(opt: Any) -> None:
    """Start recording the exact low-rank update ``W_T - W_0`` of every GaLore parameter (paper §5;
    :mod:`fedgalore.optim.update_record`; with ``track_cold``, restart the shadow cold second moment)."""
    for _, _, group, state in _items(opt):
        if state.cold_v is not None:
            F.reset_cold(state)
        update_record.start(state, F.has_basis(group, state), group["track_cold"])


def export_update(opt: Any) -> dict[str, GaLoreUpdate]:
    """Per GaLore parameter name, ``ΔW = decay·W0 + Σ_q term_q`` since :func:`mark` (paper §5, Alg. 1 line 10).

    Seeded bases give ``SeededLowRank(coef, seed, side, shape)``; data-driven bases give
    ``LowRank(coef, P)`` (right) / ``LowRank(P, coef)`` (left); identity uses ``P = I``.
    ``decay = Π_t (1 - lr_t wd) - 1``. Exact up to fp32 rounding for fp32 parameters (for
    bf16 parameters the rounding of ``W`` to bf16 is not part of the record).
    """
    out: dict[str, GaLoreUpdate] = {}
    for name, p, group in opt.galore_params():
        state = opt.state.get(p)
        if not isinstance(state, GaLoreParamState) or not state.record.on:
            raise RuntimeError(f"export_update() without mark() for parameter {name!r}")
        out[name] = update_record.export(F.whole_state(p, name, group, state), _shape(p), state.side,
                                         schedule.frame_for(group, *_shape(p), state.side))
    return out


def export_state(opt: Any) -> dict[str, GaLoreStateEntry]:
    """Per GaLore parameter name: projected moments, shape/side and basis identity (App. B state)."""
    out: dict[str, GaLoreStateEntry] = {}
    for name, p, group, state in _items(opt):
        state = F.whole_state(p, name, group, state)
        basis = F.current_basis(p, group, state)
        seeded = state.basis_seed >= 0
        out[name] = GaLoreStateEntry(
            name=name, shape=_shape(p), side=state.side, rank=int(state.rank), step=int(state.step),
            exp_avg=state.exp_avg.detach().clone(), exp_avg_sq=state.exp_avg_sq.detach().clone(),
            basis=None if basis is None else basis.detach().clone(),
            seed=int(state.basis_seed) if seeded else None,
            refresh_index=int(state.basis_refresh) if seeded else None,
            projection_seed=int(group["projection_seed"]),
            warm=state.warm_diag is not None,
            v_weight=moment_exchange.v_weight(state, state.side, group["betas"][1]).detach().flatten().clone(),
        )
    return out


def view_seed(opt: Any, name: str) -> int:
    """Seed of the round's shared view basis ``R_k`` of parameter ``name`` (paper Alg. 1 line
    13, §5 "Seeded matrix view"): ``basis_seed(s_k, name, 0)`` — a function of the round
    seed and the parameter only, identical for every client whatever its step count. It is
    also the basis of a seeded refresh at local refresh 0, so a client whose round starts in
    the seeded phase trains on ``R_k`` itself."""
    _, group = _param(opt, name)
    return schedule.view_seed(group, name)


def export_moments(opt: Any, view_seeds: Optional[dict[str, int]] = None, buffer: bool = False) -> dict[str, MomentView]:
    """Per GaLore parameter, the projected second moment as a :class:`MomentView` (paper
    Alg. 1 line 10, "upload ṽ").

    ``buffer=False``: the estimate ``V / c`` with its evidence ``c``
    (:func:`fedgalore.protocol.second_moment.estimate`; ``c = 1 - b2^s`` on every coordinate
    under ``bias_correction="steps"``). ``buffer=True``: the raw buffer ``ṽ = V`` itself, with
    no evidence (``weight=None``) — Algorithm 1 line 10 as written.

    Without ``view_seeds`` it is expressed in the current basis (the matrix, or its seed when
    seeded). With ``view_seeds[name] = s`` it is expressed in the seeded basis
    ``R = seeded_basis(s, ...)``: unless the current basis already is ``R``, ``V`` (and ``c``)
    move there by the group's ``moment_transfer`` (``C = P R^T``,
    :func:`fedgalore.protocol.second_moment.move`), and the view carries the seed only.
    """
    out: dict[str, MomentView] = {}
    for name, p, group, state in _items(opt):
        basis = F.current_basis(p, group, state)
        if basis is None:
            raise ValueError(f"parameter {name!r} has no basis yet (no optimizer step happened)")
        target = None if view_seeds is None else view_seeds.get(name)
        whole = F.whole_state(p, name, group, state)
        out[name] = moment_exchange.export_view(whole, group, state.side, _shape(p), basis, target, buffer)
        if whole is not state:
            state.upload_kept = whole.upload_kept
    return out


def load_second_moment(opt: Any, name: str, view: MomentView) -> None:
    """Warm-start ``V`` of parameter ``name`` from a synchronised state ``v̄`` (paper Alg. 1,
    lines 3 and 14; DESIGN §3.1): ``view.moment`` are its coordinates on the basis
    ``view.basis_matrix()``, ``view.weight`` their prior weights (``None``: full weight).

    Applied to the current basis, or — before the first step — to the round's first basis
    when the first refresh picks it (:func:`fedgalore.optim.moment_exchange.apply_warm`: the two rules).
    """
    p, group = _param(opt, name)
    if not isinstance(view, MomentView):
        raise TypeError(f"load_second_moment({name!r}): expected a MomentView, got {type(view).__name__}")
    if "rank" not in group:
        raise ValueError(f"parameter {name!r} is not a GaLore parameter")
    state = opt.param_state(p, group)
    moment, basis, weight = moment_exchange.check_view(name, view, state.side, _shape(p), p.device)
    state.warm = WarmStart(moment, basis, weight, -1 if view.basis is not None or view.seed is None else int(view.seed))
    current = F.current_basis(p, group, state)
    if current is not None:
        F.apply_warm(p, name, group, state, current)


def _term_basis(p: torch.Tensor, group: dict[str, Any], state: GaLoreParamState, term: RecordTerm) -> torch.Tensor:
    if term.basis is not None:
        return term.basis
    if term.seed >= 0:
        m, n = int(p.shape[0]), int(p.shape[1])
        return seeded_basis(int(term.seed), m, n, state.rank, state.side, schedule.frame_for(group, m, n, state.side)).to(p.device)
    return F.current_basis(p, group, state)


def moment_diagnostics(opt: Any) -> dict[str, dict[str, float]]:
    """Per GaLore parameter: what the warm start did (``warm_clamped``: fraction of entries
    clamped at 0; ``prior_retained``: share of the prior weight the move to the first basis
    kept) and, with ``track_cold``, since :func:`mark`: ``update_norm`` = ``‖Σ_q f_q C_q P_q‖_F``
    (the record without its decay term), ``update_norm_cold`` (the same with the shadow cold
    second moment) and ``v_ratio_median`` = median of ``V̂ / V̂_cold`` at the last step."""
    out: dict[str, dict[str, float]] = {}
    for name, p, group in opt.galore_params():
        state = opt.state.get(p)
        if not isinstance(state, GaLoreParamState):
            out[name] = {}
            continue
        d = dict(state.warm_diag or {})
        if state.step > 0:
            d["view_step_share"] = state.view_steps / state.step
        if state.upload_kept is not None:
            d["upload_kept"] = float(state.upload_kept)
        if group["track_cold"] and state.cold_v is not None and state.record.on and state.cold_step > 0:
            terms = update_record.all_terms(state, with_cold=True)
            bases = [_term_basis(p, group, state, t) for t in terms]
            d["update_norm"] = update_record.record_norm([t.coef * t.factor for t in terms], bases, state.side)
            d["update_norm_cold"] = update_record.record_norm([t.cold * t.factor for t in terms], bases, state.side)
            b2 = group["betas"][1]
            evidence = moment_exchange.v_weight(state, state.side, b2)
            warm_hat = state.exp_avg_sq / evidence.clamp(min=torch.finfo(torch.float32).tiny)
            cold_hat = state.cold_v / (1.0 - b2 ** state.cold_step)
            ok = cold_hat > 0
            d["v_ratio_median"] = float((warm_hat[ok] / cold_hat[ok]).median()) if bool(ok.any()) else float("nan")
        if state.ratio is not None and state.ratio.count > 0:
            h = state.ratio
            d.update(step_diagnostics.ratio_summary(h.hist, h.max, h.above, h.count))
        out[name] = d
    return out


def update_ratio_summary(opt: Any) -> dict[str, float]:
    """``|U| / |U_cold|`` over every coordinate of every GaLore matrix and every step since
    :func:`mark` (``track_cold``; empty without): ``update_ratio_max``, ``update_ratio_p99``
    (99th percentile, to the histogram's 1.1 % resolution, read at a bin's upper edge so that
    ratios all ≤ 1 give ≤ 1) and ``update_ratio_above`` (share of entries above 1). Above 1
    means a coordinate stepped larger than a cold start would have (module doc of
    :mod:`fedgalore.optim.galore_adamw`, ``cap_to_cold``)."""
    hist, top, above, n = None, 0.0, 0, 0
    for _, p, _ in opt.galore_params():
        st = opt.state.get(p)
        h = st.ratio if isinstance(st, GaLoreParamState) else None
        if h is not None and h.count > 0:
            hist = h.hist.clone() if hist is None else hist + h.hist
            top, above, n = max(top, h.max), above + h.above, n + h.count
    return {} if hist is None else step_diagnostics.ratio_summary(hist, top, above, n)
