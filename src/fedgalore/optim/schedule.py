"""The projector schedule of a GaLore matrix: when its basis is refreshed and which basis it gets
(paper §4 "SVD-to-random projectors", App. E; Alg. 1 line 13 for the round's view basis ``R_k``).

Two schedules, by the group key ``seeded_from_step``:

* **step count** (``-1``): refreshes at local steps ``0, τ, 2τ, …`` (``τ = update_proj_gap``); with
  a ``*_then_random`` projector the first ``adaptive_proj_steps`` refreshes are data-driven (counted
  per optimizer, i.e. per round, or from ``global_refresh_offset`` on under ``adaptive_scope="global"``)
  and the rest seeded random, seed ``basis_seed(s_k, name, q)`` at refresh ``q``;
* **epoch** (``s ≥ 0``): data-driven refreshes before local step ``s``, one refresh at step ``s``
  to ``R_k`` (seed ``basis_seed(s_k, name, 0)`` whatever the refresh index: every client's ``R_k``
  is the same), none after it, so the round ends on ``R_k``.

Not the paper's: group key ``hold_warm_basis`` (FedGaLore's ``first_basis: synced``) replaces the
epoch schedule's data-driven refreshes, for a matrix that holds a warm start, by the warm start's own
basis, kept until the switch (:func:`held_basis`).

Pure functions of the group's settings and the matrix's state (``step``, ``basis``, ``on_view``, ``held``);
:func:`fedgalore.optim.functional.refresh` applies what they decide.
"""
from __future__ import annotations

from typing import Any

import torch

from fedgalore.optim.projector import rsvd_basis, svd_basis
from fedgalore.optim.state import GaLoreParamState
from fedgalore.protocol.bases import basis_seed, seeded_basis

__all__ = ["basis_kind", "refresh_due", "held_basis", "new_basis", "view_seed", "frame_for"]


def basis_kind(group: dict[str, Any], q: int, step: int = 0) -> str:
    """Kind of the basis refresh ``q`` (at local step ``step``) picks: the projector's own
    kind; for ``*_then_random`` the data-driven kind until the switch — before local step
    ``seeded_from_step`` (epoch schedule), else for the first ``adaptive_proj_steps``
    refreshes — and ``"random"`` after it (``"view"``: the round's view basis ``R_k``,
    epoch schedule)."""
    kind = group["projector"]
    if kind.endswith("_then_random"):
        if group["seeded_from_step"] >= 0:
            return kind.split("_")[0] if step < group["seeded_from_step"] else "view"
        idx = q + (group["global_refresh_offset"] if group["adaptive_scope"] == "global" else 0)
        return kind.split("_")[0] if idx < group["adaptive_proj_steps"] else "random"
    return kind


def refresh_due(group: dict[str, Any], state: GaLoreParamState) -> bool:
    """Whether this step starts with a refresh: at the first step; then every ``τ =
    update_proj_gap`` steps — under the epoch schedule (``seeded_from_step = s``) only
    before step ``s`` (none before it while a held warm-start basis is in use,
    :func:`held_basis`), once at step ``s`` (the switch to ``R_k``), and never after it, so
    the round ends on ``R_k``."""
    if state.basis is None:
        return True
    t, switch = state.step, group["seeded_from_step"]
    if switch >= 0 and group["projector"].endswith("_then_random"):
        if t >= switch:
            return t == switch and not state.on_view
        if state.held:  # hold_warm_basis: the warm start's basis until the switch
            return False
    return t % group["update_proj_gap"] == 0


def held_basis(group: dict[str, Any], state: GaLoreParamState, kind: str, m: int, n: int,
               device: torch.device) -> tuple[torch.Tensor, int] | None:
    """Group key ``hold_warm_basis`` (NOT the paper's schedule; FedGaLore's ``first_basis: synced``):
    the basis a refresh of the data-driven phase (``kind`` ``svd`` / ``rsvd``) takes instead of a
    data-driven one when a warm start is pending — the basis ``B`` the synchronised ``v̄`` is
    expressed on, so the warm start moves nothing (``C = B Bᵀ = I`` to fp32 rounding) — and its
    seed (−1 for a matrix). A seeded ``B`` is rebuilt from its seed at this matrix's rank and frame
    (the leading block of ``v̄``'s frame at a lower site rank), as the record's seeded term will be
    materialised; a matrix ``B`` gives its leading ``rank`` vectors. None: the refresh proceeds as
    without the key (key off, no warm start, the seeded phase, or a matrix ``B`` of lower rank)."""
    warm = state.warm
    if not group["hold_warm_basis"] or warm is None or kind not in ("svd", "rsvd"):
        return None
    side, rank = state.side, state.rank
    if warm.seed >= 0:
        return seeded_basis(int(warm.seed), m, n, rank, side, frame_for(group, m, n, side)).to(device), int(warm.seed)
    b = warm.basis
    have = b.shape[0] if side == "right" else b.shape[1]
    if have < rank:
        return None
    return (b[:rank] if side == "right" else b[:, :rank]).to(device=device, dtype=torch.float32).contiguous().clone(), -1


def view_seed(group: dict[str, Any], name: str) -> int:
    """Seed of the round's view basis ``R_k`` of parameter ``name``: ``basis_seed(s_k, name, 0)``."""
    return basis_seed(int(group["projection_seed"]), name, 0)


def frame_for(group: dict[str, Any], m: int, n: int, side: str) -> int | None:
    """The seeded frame of an ``m × n`` matrix's bases: the group's ``frame_rank`` capped at the
    side's dimension (a frame never exceeds it), or None (each rank its own draw)."""
    frame = group.get("frame_rank")
    return None if frame is None else min(int(frame), n if side == "right" else m)


def new_basis(kind: str, group: dict[str, Any], name: str, q: int, g32: torch.Tensor, rank: int, side: str,
              device: torch.device) -> tuple[torch.Tensor, int]:
    """The basis of refresh ``q`` of kind ``kind`` (:func:`basis_kind`) and its seed (``-1`` for a
    data-driven basis): seeded Haar (``random``: seed of refresh ``q``; ``view``: ``R_k``), the
    seeded randomised SVD of the gradient (``rsvd``; sketch seed ``basis_seed(s_k, name#rsvd, q)``,
    so every rank and every rerun picks the same) or its exact SVD (``svd``)."""
    m, n = g32.shape
    if kind in ("random", "view"):
        seed = basis_seed(group["projection_seed"], name, 0 if kind == "view" else q)
        return seeded_basis(seed, m, n, rank, side, frame_for(group, m, n, side)).to(device), seed
    if kind == "rsvd":
        rseed = basis_seed(group["projection_seed"], name + "#rsvd", q)
        return rsvd_basis(g32, rank, side, rseed, group["rsvd_oversample"], group["rsvd_niter"]), -1
    return svd_basis(g32, rank, side), -1
