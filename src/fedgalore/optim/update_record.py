"""The exact update record of one GaLore matrix (paper §5 "Seeded matrix view"; DESIGN §3.1).

Between :meth:`~fedgalore.optim.galore_adamw.GaLoreAdamW.mark` and the upload a GaLore weight
moves by

    ΔW = W_T − W_0 = (a − 1) W_0 + Σ_q f_q C_q P_q        (right side; left: P_q C_q),

one term per basis ``P_q`` the matrix trained on: ``C_q`` accumulates the step directions
``α_t U_t`` taken on that basis, ``f_q`` the weight decay applied since the term closed, and
``a = Π_t d_t`` with ``d_t = 1 − lr_t wd``. The terms are factored (``m × r`` / ``r × n``) and
a seeded basis travels as its seed, so the record is the upload without an ``m × n`` tensor.

The record lives in the optimizer's per-parameter state (tensors and plain numbers only, so
``state_dict()`` stays ``weights_only``-loadable): ``rec_on``, ``rec_A`` (= ``a``), ``rec_terms``
(closed terms: ``coef``, ``factor``, ``seed`` and, for a data-driven basis, ``basis``) and the open
term ``rec_coef`` / ``rec_n`` (and ``rec_cold``, the shadow cold-start coefficients that
``track_cold`` diagnostics compare against). These functions are the only code that changes them.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from fedgalore.protocol.payload import GaLoreUpdate, LowRank, SeededLowRank

__all__ = ["start", "open_term", "close_term", "record", "export", "all_terms", "record_norm"]


def start(state: dict[str, Any], has_basis: bool, track_cold: bool) -> None:
    """Begin a record (``mark``): ``a = 1``, no terms, and an open term if a basis is in use."""
    state["rec_on"] = 1
    state["rec_A"] = 1.0
    state["rec_terms"] = []
    for key in ("rec_coef", "rec_n", "rec_cold"):
        state.pop(key, None)
    if has_basis:
        open_term(state, track_cold)


def open_term(state: dict[str, Any], track_cold: bool) -> None:
    """A new term ``C = 0`` for the basis now in use (and its shadow cold coefficients with ``track_cold``)."""
    state["rec_coef"] = torch.zeros_like(state["exp_avg"])
    state["rec_n"] = 0
    if "cold_v" in state and track_cold:  # the cold update feeds the diagnostics only
        state["rec_cold"] = torch.zeros_like(state["exp_avg"])


def close_term(state: dict[str, Any]) -> None:
    """Close the open term before a refresh: kept (with its basis or seed) if any step was recorded."""
    if "rec_coef" not in state:
        return
    coef = state.pop("rec_coef")
    cold = state.pop("rec_cold", None)
    if state.pop("rec_n") > 0:
        term = {"coef": coef, "factor": 1.0, "seed": state["basis_seed"]}
        if state["basis_seed"] < 0 and "basis" in state:
            term["basis"] = state["basis"]
        if cold is not None:
            term["cold"] = cold
        state["rec_terms"].append(term)


def record(state: dict[str, Any], u: torch.Tensor, alpha: float, decay: float, after: bool,
           cold: Optional[tuple[torch.Tensor, torch.Tensor, float]] = None) -> None:
    """Keep ``ΔW = (a_t - 1) W0 + Σ_q f_q C_q P_q`` exact under decay ``d_t = 1 - lr_t wd``.

    torch order (decay, then update): ``C <- d C + alpha U``; compat order (update, then
    decay): ``C <- d (C + alpha U)``. Every step ``a <- d a`` and each closed term's factor
    ``f_q <- d f_q``. With ``track_cold`` the shadow coefficients follow the torch-order rule
    with the cold-start direction ``U_cold = M / D_cold``, given as ``cold = (M, D_cold,
    alpha_cold)`` (one fused ``addcdiv_``, no ``U_cold`` tensor).
    """
    c = state["rec_coef"]
    if after:
        c.add_(u, alpha=alpha)
        if decay != 1.0:
            c.mul_(decay)
    else:
        if decay != 1.0:
            c.mul_(decay)
        c.add_(u, alpha=alpha)
    if cold is not None and "rec_cold" in state:
        cc = state["rec_cold"]
        if decay != 1.0:
            cc.mul_(decay)
        cc.addcdiv_(cold[0], cold[1], value=cold[2])
    state["rec_n"] += 1
    if decay != 1.0:
        state["rec_A"] *= decay
        for term in state["rec_terms"]:
            term["factor"] *= decay


def all_terms(state: dict[str, Any], with_cold: bool = False) -> list[dict[str, Any]]:
    """The closed terms and the open one (if it recorded a step), as term dicts."""
    terms = list(state["rec_terms"])
    if "rec_coef" in state and state.get("rec_n", 0) > 0:
        cur = {"coef": state["rec_coef"], "factor": 1.0, "seed": state["basis_seed"]}
        if "basis" in state and (state["basis_seed"] < 0 or with_cold):
            cur["basis"] = state["basis"]
        if with_cold:
            cur["cold"] = state["rec_cold"]
        terms.append(cur)
    return terms


def export(state: dict[str, Any], shape: tuple[int, int], side: str) -> GaLoreUpdate:
    """The record as the upload's :class:`~fedgalore.protocol.payload.GaLoreUpdate`:
    ``decay = a − 1``; seeded terms as ``SeededLowRank(f C, seed)``, data-driven ones as
    ``LowRank(f C, P)`` (right) / ``LowRank(P, f C)`` (left), the identity projector with ``P = I``.
    fp32, on the CPU."""
    terms: list[Any] = []
    for term in all_terms(state):
        coef = (term["coef"] * term["factor"]).detach().cpu()
        if term["seed"] >= 0:
            terms.append(SeededLowRank(coef, int(term["seed"]), side, shape))
            continue
        basis = term.get("basis")
        if basis is None:  # identity projector
            basis = torch.eye(shape[1] if side == "right" else shape[0])
        basis = basis.detach().float().cpu().clone()
        terms.append(LowRank(coef, basis) if side == "right" else LowRank(basis, coef))
    return GaLoreUpdate(float(state["rec_A"]) - 1.0, tuple(terms), shape)


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
