"""The projected second moment and its evidence: one statement of each rule (DESIGN §3.1, §8).

GaLore-AdamW (paper App. B) keeps, per adapted matrix ``W (m × n)``, the second moment in the
coordinates of a rank-``r`` basis ``P``: an accumulator ``V`` (``m × r`` on the right side,
``r × n`` on the left) fed ``V ← β₂V + (1−β₂) R∘R`` with the projected gradient ``R``. Its
*evidence* ``c`` is, per basis coordinate ``j``, the mass the exponential average has gathered:
``c_j = 1 − β₂^s`` after ``s`` steps from zero — Adam's bias-correction denominator — so the
estimate of ``E[g̃²]`` is ``v̂ = V / c``. The client optimizer, the upload, the server's pooling
and the next round's warm start all move or combine ``(V, c)``; this module states each of those
rules once, as a pure function on tensors, and ``tests/sync/test_second_moment.py`` checks each
against its equation and its laws:

* :func:`observe` — one Adam step (paper App. B, Alg. 3 line "update second moment"):
  ``V ← β₂V + (1−β₂) R∘R``, ``c ← β₂c + (1−β₂)``. From ``(0, 0)``, ``s`` steps give
  ``c = 1 − β₂^s`` and ``V / c`` is AdamW's bias-corrected ``v / (1 − β₂^s)``.
* :func:`move` — a change of basis ``C = P_old P_newᵀ`` (right) / ``P_newᵀ P_old`` (left), by rule:

  - ``squared``: ``V ← V (C∘C)``, ``c ← c (C∘C)`` — the second moment of ``g·p_new`` when the
    old coordinates are uncorrelated; non-negative; unchanged when any basis vector flips sign;
    the identity for ``C = I``; and a new direction the old basis does not span gets no evidence,
    so fresh gradients set its scale;
  - ``linear``: ``V ← max(V C, 0)`` with ``c`` unchanged — the paper's buffer reprojection
    (App. B) followed by the clamp a second moment needs. It is meaningful only when ``c`` is one
    number for every coordinate (AdamW's step count): with per-coordinate evidence ``V C / c`` is
    no longer an average of old estimates (after an RSVD → random refresh 20 % of entries fell
    below half of ``E[g̃²]`` and 34 % above ten times it), so :func:`move` refuses it;
  - ``keep`` (the official GaLore package: untouched) and ``reset`` (zeros).
* :func:`estimate` — ``v̂ = V / c`` (0 where ``c = 0``: no evidence, no estimate).
* :func:`pool` — the server's combination of several clients' estimates on one basis, weighted by
  client weight *and* evidence: ``ē_j = Σ_i p_i c_ij v̂_ij / Σ_i p_i c_ij``, ``c̄ = Σ_i p_i c_i``
  — i.e. the pooled accumulator ``Σ p_i V_i`` over the pooled evidence. A client with almost no
  evidence for a coordinate cannot drag it (estimates 1 with ``c = 0.5`` and 100 with ``c = 1e-6``
  pool to ≈ 1, not 50.5). Pooling ``K`` copies of an estimate returns it; the weights are
  scale-invariant. Without evidence (``None``) every coordinate counts fully: ``Σ p_i v̂_i``.
* :func:`warm_aligned` / :func:`warm_paper` — a client starting its round from the server's
  synchronised state (Algorithm 1 line 3), in the two protocols of
  :mod:`fedgalore.methods.fedgalore`.

Evidence tensors are shaped to broadcast against ``V``: ``(1, r)`` on the right side, ``(r, 1)``
on the left (:func:`evidence_shape`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["RULES", "evidence_shape", "as_evidence", "observe", "move", "estimate", "pool", "warm_aligned",
           "warm_paper", "apply_change"]

RULES = ("linear", "squared", "keep", "reset")


def evidence_shape(side: str, rank: int) -> tuple[int, int]:
    """Shape of an evidence tensor that broadcasts against a ``side``-side moment of rank ``rank``."""
    return (1, rank) if side == "right" else (rank, 1)


def as_evidence(c: Optional[torch.Tensor], side: str, rank: int, like: torch.Tensor) -> torch.Tensor:
    """``c`` (any shape with ``rank`` entries; ``None`` = full evidence, ones) as an evidence
    tensor of :func:`evidence_shape` with ``like``'s dtype and device."""
    shape = evidence_shape(side, rank)
    if c is None:
        return torch.ones(shape, dtype=like.dtype, device=like.device)
    return c.to(dtype=like.dtype, device=like.device).reshape(shape)


def apply_change(x: torch.Tensor, c: torch.Tensor, side: str) -> torch.Tensor:
    """Coordinates ``x`` on an old basis expressed on a new one: ``x C`` (right) / ``C x`` (left)."""
    return x @ c if side == "right" else c @ x


def observe(v: torch.Tensor, c: torch.Tensor, r: torch.Tensor, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One Adam step on the projected gradient ``r``: ``(β₂V + (1−β₂) r∘r, β₂c + (1−β₂))``."""
    return beta2 * v + (1.0 - beta2) * r * r, beta2 * c + (1.0 - beta2)


def move(v: torch.Tensor, c: torch.Tensor, change: torch.Tensor, side: str, rule: str,
         per_coordinate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(V, c)`` moved to a new basis by ``rule`` (module doc); ``change`` is ``C`` of
    :func:`fedgalore.protocol.bases.change_of_basis`. ``per_coordinate=False`` says that ``c``
    is AdamW's step count, the same number for every coordinate: then ``c`` is not moved by
    ``linear`` or ``squared`` (the step count does not change with the basis) and ``linear`` is
    allowed. ``per_coordinate=True`` with ``linear`` raises ``ValueError``."""
    if rule == "keep":
        return v, c
    if rule == "reset":
        return (torch.zeros_like(apply_change(v, change, side)),
                torch.zeros_like(apply_change(c, change, side) if per_coordinate else c))
    if rule == "linear":
        if per_coordinate:
            raise ValueError("moment_transfer='linear' with per-coordinate evidence (bias_correction='weight') is not an "
                             "average of old estimates; use moment_transfer='squared' (or bias_correction='steps')")
        return apply_change(v, change, side).clamp_(min=0.0), c
    if rule == "squared":
        sq = change * change
        return apply_change(v, sq, side), (apply_change(c, sq, side) if per_coordinate else c)
    raise ValueError(f"unknown moment_transfer {rule!r}; expected one of {RULES}")


def estimate(v: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``v̂ = V / c`` where ``c > 0``, else 0."""
    return torch.where(c > 0, v / c.clamp(min=torch.finfo(v.dtype).tiny), torch.zeros_like(v))


def pool(estimates: Sequence[torch.Tensor], evidence: Optional[Sequence[torch.Tensor]],
         weights: Sequence[float]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Evidence-weighted pooling on one basis (module doc): ``ē = Σ_i p_i c_i∘v̂_i / Σ_i p_i c_i``
    and ``c̄ = Σ_i p_i c_i``, with ``p`` the weights normalised to sum 1. A coordinate no client
    has evidence for (``c̄_j = 0``) gets the plain weighted mean ``Σ p_i v̂_ij`` (all of them are 0
    for estimates made by :func:`estimate`). ``evidence=None``: ``(Σ_i p_i v̂_i, None)``."""
    total = float(sum(float(w) for w in weights))
    if total <= 0.0:
        raise ValueError("pool weights must not all be zero")
    p = [float(w) / total for w in weights]
    plain = sum(pi * e for pi, e in zip(p, estimates))
    if evidence is None:
        return plain, None
    cbar = sum(pi * c for pi, c in zip(p, evidence))
    mass = sum(pi * c * e for pi, c, e in zip(p, evidence, estimates))
    return torch.where(cbar > 0, mass / cbar.clamp(min=torch.finfo(mass.dtype).tiny), plain), cbar


def warm_aligned(x: torch.Tensor, c: Optional[torch.Tensor], change: torch.Tensor, side: str,
                 rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The aligned protocol's warm start: the synchronised estimate ``x`` (clamped at 0: AJIVE's
    projection can leave small negative entries) with evidence ``c`` (``None``: full) becomes the
    accumulator ``V = max(x, 0)∘c`` on the basis it is expressed in — exact: its estimate is ``x``
    again — and moves to the client's first basis by ``rule`` like an in-round refresh
    (``change = I`` when that basis is the state's own). Returns ``(V, c)`` on the new basis."""
    rank = x.shape[1] if side == "right" else x.shape[0]
    ev = as_evidence(c, side, rank, x)
    if rule == "keep":
        if change.shape[0] != change.shape[1]:
            raise ValueError("moment_transfer='keep' needs the synchronised state at the optimizer's rank")
        return x.clamp(min=0.0) * ev, ev
    return move(x.clamp(min=0.0) * ev, ev, change, side, rule, per_coordinate=True)


def warm_paper(x: torch.Tensor, change: torch.Tensor, side: str) -> torch.Tensor:
    """Algorithm 1 line 3 as written: the next round's GaLoreAdamW buffer is the synchronised
    buffer ``x`` re-projected *linearly* onto the client's first basis and clamped at 0,
    ``V₀ = max(x C, 0)`` (App. B's buffer reprojection); the optimizer then runs as a freshly
    initialised AdamW does, its bias correction counting the steps of this round."""
    return apply_change(x, change, side).clamp_(min=0.0)
