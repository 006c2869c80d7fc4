"""The exact update record of one GaLore matrix (paper §5 "Seeded matrix view"; DESIGN §3.1).

Between :func:`fedgalore.optim.client_protocol.mark` and the upload a GaLore weight
moves by

    ΔW = W_T − W_0 = (a − 1) W_0 + Σ_q f_q C_q P_q        (right side; left: P_q C_q),

one term per basis ``P_q`` the matrix trained on: ``C_q`` accumulates the step directions
``α_t U_t`` taken on that basis, ``f_q`` the weight decay applied since the term closed, and
``a = Π_t d_t`` with ``d_t = 1 − lr_t wd``. The terms are factored (``m × r`` / ``r × n``) and
a seeded basis travels as its seed, so the record is the upload without an ``m × n`` tensor.

The record is the typed :class:`~fedgalore.optim.state.UpdateRecord` of a matrix's
:class:`~fedgalore.optim.state.GaLoreParamState`: ``on``, ``decay_product`` (= ``a``), the closed
``terms`` (:class:`~fedgalore.optim.state.RecordTerm`: ``coef``, ``factor``, ``seed`` and, for a
data-driven basis, ``basis``) and the open term ``coef`` / ``steps`` (and ``cold``, the shadow
cold-start coefficients that ``track_cold`` diagnostics compare against). These functions are the
only code that changes it.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from fedgalore.optim.state import GaLoreParamState, RecordTerm, UpdateRecord
from fedgalore.protocol.bases import frame_of
from fedgalore.protocol.payload import GaLoreUpdate, LowRank, SeededLowRank

__all__ = ["start", "open_term", "close_term", "record", "export", "all_terms", "record_norm"]


def start(state: GaLoreParamState, has_basis: bool, track_cold: bool) -> None:
    """Begin a record (``mark``): ``a = 1``, no terms, and an open term if a basis is in use."""
    state.record = UpdateRecord(on=True)
    if has_basis:
        open_term(state, track_cold)


def open_term(state: GaLoreParamState, track_cold: bool) -> None:
    """A new term ``C = 0`` for the basis now in use (and its shadow cold coefficients with ``track_cold``)."""
    rec = state.record
    rec.coef = torch.zeros_like(state.exp_avg)
    rec.steps = 0
    if state.cold_v is not None and track_cold:  # the cold update feeds the diagnostics only
        rec.cold = torch.zeros_like(state.exp_avg)


def close_term(state: GaLoreParamState) -> None:
    """Close the open term before a refresh: kept (with its basis or seed) if any step was recorded."""
    rec = state.record
    if rec.coef is None:
        return
    coef, cold, steps = rec.coef, rec.cold, rec.steps
    rec.coef, rec.cold, rec.steps = None, None, 0
    if steps > 0:
        basis = state.basis if state.basis_seed < 0 else None
        rec.terms.append(RecordTerm(coef, 1.0, state.basis_seed, basis, cold))


def record(state: GaLoreParamState, u: torch.Tensor, alpha: float, decay: float, after: bool,
           cold: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> None:
    """Keep ``ΔW = (a_t - 1) W0 + Σ_q f_q C_q P_q`` exact under decay ``d_t = 1 - lr_t wd``.

    torch order (decay, then update): ``C <- d C + alpha U``; compat order (update, then
    decay): ``C <- d (C + alpha U)``. Every step ``a <- d a`` and each closed term's factor
    ``f_q <- d f_q``. With ``track_cold`` the shadow coefficients follow the torch-order rule
    with the cold-start direction ``U_cold = M / D_cold``, given as ``cold = (M, D_cold,
    alpha_cold)`` (one fused ``addcdiv_``, no ``U_cold`` tensor).
    """
    rec = state.record
    c = rec.coef
    if after:
        c.add_(u, alpha=alpha)
        if decay != 1.0:
            c.mul_(decay)
    else:
        if decay != 1.0:
            c.mul_(decay)
        c.add_(u, alpha=alpha)
    if cold is not None and rec.cold is not None:
        cold_coef = rec.cold
        if decay != 1.0:
            cold_coef.mul_(decay)
        cold_coef.addcdiv_(cold[0], cold[1], value=cold[2])
    rec.steps += 1
    if decay != 1.0:
        rec.decay_product *= decay
        for term in rec.terms:
            term.factor *= decay


def all_terms(state: GaLoreParamState, with_cold: bool = False) -> list[RecordTerm]:
    """The closed terms and the open one (if it recorded a step)."""
    rec = state.record
    terms = list(rec.terms)
    if rec.coef is not None and rec.steps > 0:
        basis = state.basis if state.basis_seed < 0 or with_cold else None
        terms.append(RecordTerm(rec.coef, 1.0, state.basis_seed, basis, rec.cold if with_cold else None))
    return terms


def export(state: GaLoreParamState, shape: tuple[int, int], side: str, frame: int | None = None) -> GaLoreUpdate:
    """The record as the upload's :class:`~fedgalore.protocol.payload.GaLoreUpdate`:
    ``decay = a − 1``; seeded terms as ``SeededLowRank(f C, seed)``, data-driven ones as
    ``LowRank(f C, P)`` (right) / ``LowRank(P, f C)`` (left), the identity projector with ``P = I``.
    fp32, on the CPU. ``frame``: the seeded frame the bases were drawn from (nested bases of sites at
    different ranks; recorded on a seeded term only when it differs from the term's rank)."""
    terms: list[Any] = []
    for term in all_terms(state):
        coef = (term.coef * term.factor).detach().cpu()
        if term.seed >= 0:
            rank = coef.shape[1] if side == "right" else coef.shape[0]
            terms.append(SeededLowRank(coef, int(term.seed), side, shape, frame_of(rank, frame)))
            continue
        basis = term.basis
        if basis is None:  # identity projector
            basis = torch.eye(shape[1] if side == "right" else shape[0])
        basis = basis.detach().float().cpu().clone()
        terms.append(LowRank(coef, basis) if side == "right" else LowRank(basis, coef))
    return GaLoreUpdate(float(state.record.decay_product) - 1.0, tuple(terms), shape)
def record_norm(coefs: list[torch.Tensor], bases: list[torch.Tensor], side: str) -> float:
    """``‖Σ_q C_q P_q‖_F`` (right) / ``‖Σ_q P_q C_q‖_F`` (left) from ``r × r`` basis overlaps."""
    total = 0.0
    for i, (ci, pi) in enumerate(zip(coefs, bases)):
        for j, (cj, pj) in enumerate(zip(coefs, bases)):
            if side == "right":
                total += float(((ci @ (pi @ pj.T)) * cj).sum())
            else:
                total += float(((pi.T @ pj) @ cj * ci).sum())
    return math.sqrt(max(total, 0.0))
