"""Server-side second-moment synchronisation ``S`` (paper §5, Algorithm 1 lines 11–13; DESIGN §3.2).

Client ``i`` uploads its projected second moment and basis identity (:class:`MomentView`); its
full-space view is ``V_i = v_i P_i`` (right side, ``m × n``) or ``P_i v_i`` (left side). The server
returns one synchronised full-space state ``v̄`` in factored form; each client projects it on its
next basis and clamps at 0 (:func:`project_moment`). No ``m × n`` matrix is formed.

Orientation. AJIVE's shared index (rows) is the *unprojected* dimension of the moment: ``m`` for
right-side views (``V_i = v_i P_i``, scores in ``R^m``), ``n`` for left-side views (run on
``V_iᵀ = v_iᵀ P_iᵀ``). With a shared seeded basis the other side is the same ``r``-dimensional
space for every client, so joint structure there would be trivial; the informative agreement is
between the columns of the ``v_i``.

Modes (``v̄`` as a function of views ``V_i`` and weights ``p_i``, normalised to sum 1):

* ``none``     – no synchronisation (FedGaLore⁻); ``state`` is ``None``.
* ``mean``     – ``v̄ = Σ_i p_i V_i`` (thin factored form, numerical rank).
* ``mean_svd`` – the best rank-``k`` approximation of ``Σ_i p_i V_i``.
* ``ajive``    – ``v̄ = Σ_i p_i (1 μ_iᵀ + J_i)`` with ``J_i = U_J U_Jᵀ (V_i − 1 μ_iᵀ)`` from
  :func:`fedgalore.sync.ajive.ajive` (joint rank ``k`` = view rank ``r`` by default, or ``"auto"``
  for the Wedin / random-direction estimate). Joint rank 0 gives ``Σ p_i 1 μ_iᵀ``.

Diagnostics (all computed from factors via Frobenius Gram matrices):

* ``mismatch_before`` = ``Σ_i p_i ‖V_i − V̄‖_F / ‖V̄‖_F``, ``V̄ = Σ p_i V_i`` (paper §4.2's
  second-moment mismatch across clients, before synchronisation);
* ``mismatch_after``  = ``Σ_i p_i ‖V_i − v̄‖_F / ‖v̄‖_F``: after sync every client restarts from
  the same ``v̄``, so the cross-client mismatch is 0 by construction; what remains meaningful is
  how far the broadcast state is from each client's own view (equal to ``mismatch_before`` for
  ``mean``; for ``none`` it is ``mismatch_before``, clients keep their states);
* ``removed_fraction`` = ``‖V̄ − v̄‖_F / ‖V̄‖_F``: share of the plain average the sync filters out;
* ``joint_rank`` (rank of the synchronised component: AJIVE's final joint rank, ``k`` for
  ``mean_svd``, the state rank for ``mean``, 0 for ``none``), ``state_rank``, ``n_views``,
  ``time_s`` (wall time of the whole call, diagnostics included).
Zero norms give 0 ratios.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

from fedgalore.federated.payload import Factored, MomentView
from fedgalore.sync.ajive import ajive, thin_svd_factored

__all__ = ["SyncResult", "MODES", "synchronize", "synchronize_moments", "project_moment", "frobenius_gram"]

MODES = ("none", "mean", "mean_svd", "ajive")


@dataclass
class SyncResult:
    """``state``: the synchronised full-space second moment ``v̄`` (``m × n``) as
    ``Factored(left, core, right)`` (``None`` for mode ``none``); ``diagnostics``: see module doc."""

    state: Factored | None
    diagnostics: dict[str, float] = field(default_factory=dict)


# ----------------------------------------------------------------------------- factored helpers
def _thin(left: torch.Tensor, right: torch.Tensor, rank: int | None = None) -> Factored:
    """``X = left @ right.T`` as ``Factored(U, diag(s), V)`` (thin SVD on factors, numerical rank,
    optionally truncated to ``rank`` — Eckart–Young)."""
    eye = torch.eye(left.shape[1], dtype=left.dtype, device=left.device)
    if left.shape[1] == 0:
        u, s, v = left, left.new_zeros(0), right
    else:
        u, s, v = thin_svd_factored(left, eye, right)
    if rank is not None:
        u, s, v = u[:, :rank], s[:rank], v[:, :rank]
    return Factored(u, torch.diag(s), v)


def frobenius_gram(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], shared_right: bool = False) -> torch.Tensor:
    """Gram matrix ``G_jl = ⟨A_j B_jᵀ, A_l B_lᵀ⟩_F = Σ (A_jᵀA_l) ∘ (B_jᵀB_l)`` in float64.

    With ``shared_right`` (every ``B_j`` equal, e.g. one seeded basis) it is
    ``⟨A_j BᵀB, A_l⟩``: ``O(K m r² + K² m r)`` instead of ``O(m (Σr)²)``."""
    if shared_right:
        b = pairs[0][1].double()
        btb = b.T @ b
        raw = torch.stack([a.double() for a, _ in pairs])  # K × m × r
        return (raw @ btb).reshape(len(pairs), -1) @ raw.reshape(len(pairs), -1).T
    a = torch.cat([p[0] for p in pairs], 1).double()
    b = torch.cat([p[1] for p in pairs], 1).double()
    ata, btb = a.T @ a, b.T @ b
    offs = [0]
    for p in pairs:
        offs.append(offs[-1] + p[0].shape[1])
    K = len(pairs)
    g = torch.empty(K, K, dtype=torch.float64, device=a.device)
    for j in range(K):
        for l in range(K):
            sj, sl = slice(offs[j], offs[j + 1]), slice(offs[l], offs[l + 1])
            g[j, l] = (ata[sj, sl] * btb[sj, sl]).sum()
    return g


def _inner_with_state(pairs, state: Factored) -> torch.Tensor:
    """``⟨A_i B_iᵀ, L C Rᵀ⟩_F = Σ (A_iᵀ L C) ∘ (B_iᵀ R)`` for every view (float64)."""
    lc = (state.left @ state.core).double()
    r = state.right.double()
    return torch.stack([((a.double().T @ lc) * (b.double().T @ r)).sum() for a, b in pairs])


def _ratio(num: float, den: float) -> float:
    return 0.0 if den <= 0.0 else num / den


# ----------------------------------------------------------------------------- sync on factors
def _check_weights(weights: Sequence[float], k: int) -> torch.Tensor:
    if len(weights) != k:
        raise ValueError(f"got {len(weights)} weights for {k} views")
    p = torch.tensor([float(w) for w in weights], dtype=torch.float64)
    if not bool(torch.isfinite(p).all()) or bool((p < 0).any()) or float(p.sum()) <= 0:
        raise ValueError("weights must be finite, non-negative and not all zero")
    return p / p.sum()


def synchronize(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    weights: Sequence[float],
    mode: str,
    joint_rank: Union[int, str, None] = None,
    center: bool = True,
    seed: int = 0,
    diagnostics: bool = True,
    **ajive_options,
) -> SyncResult:
    """Synchronise views ``X_i = A_i B_iᵀ`` (``m × d``, rows = AJIVE's shared index); see the
    module doc for the modes. ``joint_rank`` defaults to the view rank ``max_i rank(A_i)``.
    Returns ``v̄`` as :class:`Factored` in the same orientation (``m × d``)."""
    t0 = time.perf_counter()
    if mode not in MODES:
        raise ValueError(f"unknown sync mode {mode!r}; expected one of {MODES}")
    if len(pairs) == 0:
        raise ValueError("cannot synchronise zero views")
    for i, (a, b) in enumerate(pairs):
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
            raise ValueError(f"view {i}: factors must be (m × r) and (d × r)")
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            raise ValueError(f"view {i} contains NaN or Inf")
    m, d = pairs[0][0].shape[0], pairs[0][1].shape[0]
    if any(a.shape[0] != m or b.shape[0] != d for a, b in pairs):
        raise ValueError("all views must have the same shape")
    p = _check_weights(weights, len(pairs))
    dtype = pairs[0][0].dtype
    shared = all(b is pairs[0][1] or (b.shape == pairs[0][1].shape and torch.equal(b, pairs[0][1])) for _, b in pairs)
    view_rank = max(a.shape[1] for a, _ in pairs)
    if joint_rank is None:
        joint_rank = view_rank
    if joint_rank != "auto" and (not isinstance(joint_rank, int) or joint_rank < 0):
        raise ValueError("joint_rank must be a non-negative int or 'auto'")
    pw = [float(x) for x in p]

    state: Factored | None = None
    jr = 0.0
    if mode in ("mean", "mean_svd"):
        if shared:
            left = sum(w * a for w, (a, _) in zip(pw, pairs))
            right = pairs[0][1]
        else:
            left = torch.cat([w * a for w, (a, _) in zip(pw, pairs)], 1)
            right = torch.cat([b for _, b in pairs], 1)
        if mode == "mean_svd" and joint_rank == "auto":
            raise ValueError("mode 'mean_svd' needs an integer rank")
        state = _thin(left, right, None if mode == "mean" else int(joint_rank))
        jr = float(state.core.shape[0])
    elif mode == "ajive":
        eyes = [torch.eye(a.shape[1], dtype=dtype, device=a.device) for a, _ in pairs]
        views = [Factored(a, e, b) for (a, b), e in zip(pairs, eyes)]
        opts = dict(ajive_options)
        opts.setdefault("init_signal_ranks", [max(a.shape[1], 1) for a, _ in pairs])
        opts.setdefault("compute_individual", False)
        opts.setdefault("check_finite", False)  # checked above
        res = ajive(views, joint_rank=None if joint_rank == "auto" else int(joint_rank), center=center, seed=seed, **opts)
        uj = res.joint_scores
        jr = float(res.joint_rank)
        w = sum(pw[i] * (res.joint_rights[i] @ res.joint_coefs[i].T) for i in range(len(pairs)))  # d × J
        if center:
            mubar = sum(pw[i] * res.means[i] for i in range(len(pairs)))
            ones = torch.ones(m, 1, dtype=dtype, device=uj.device)
            left = torch.cat([ones, uj], 1)
            right = torch.cat([mubar[:, None], w], 1)
        else:
            left, right = uj, w
        state = _thin(left, right)

    diag: dict[str, float] = {"n_views": float(len(pairs)), "joint_rank": jr}
    diag["state_rank"] = float(state.core.shape[0]) if state is not None else 0.0
    if diagnostics:
        g = frobenius_gram(pairs, shared_right=shared).cpu()
        pv = p.to(g.dtype)
        gp = g @ pv
        mean_sq = float(pv @ gp)
        dev = torch.sqrt((torch.diagonal(g) - 2 * gp + mean_sq).clamp_min(0))
        before = _ratio(float(pv @ dev), math.sqrt(max(mean_sq, 0.0)))
        diag["mismatch_before"] = before
        if state is None:
            diag["mismatch_after"] = before
            diag["removed_fraction"] = 0.0
        else:
            inner = _inner_with_state(pairs, state).cpu()
            s_sq = float((state.core.double() ** 2).sum())  # core is diagonal from _thin
            dev_s = torch.sqrt((torch.diagonal(g) - 2 * inner + s_sq).clamp_min(0))
            diag["mismatch_after"] = _ratio(float(pv @ dev_s), math.sqrt(s_sq))
            diag["removed_fraction"] = _ratio(
                math.sqrt(max(mean_sq - 2 * float(pv @ inner) + s_sq, 0.0)), math.sqrt(max(mean_sq, 0.0))
            )
    diag["time_s"] = time.perf_counter() - t0
    return SyncResult(state, diag)


# ----------------------------------------------------------------------------- MomentView API
def _pairs_from_views(views: Sequence[MomentView]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    if len(views) == 0:
        raise ValueError("cannot synchronise zero views")
    side, shape = views[0].side, tuple(views[0].shape)
    if side not in ("right", "left"):
        raise ValueError(f"unknown moment side {side!r}")
    pairs = []
    cache: dict[tuple, torch.Tensor] = {}  # one basis per tensor / per seed: rebuilt once, shared
    for i, v in enumerate(views):
        if v.side != side or tuple(v.shape) != shape:
            raise ValueError("all moment views of one parameter must have the same side and shape")
        if v.basis is not None:
            key = ("tensor", id(v.basis))
        elif v.seed is not None:
            key = ("seed", int(v.seed), tuple(v.moment.shape))
        else:
            key = None
        if key is not None and key in cache:
            p = cache[key]
        else:
            # explicit bases keep the moment's dtype (basis_matrix() casts to float32)
            raw = v.basis if v.basis is not None else v.basis_matrix()
            p = raw.to(device=v.moment.device, dtype=v.moment.dtype if v.moment.is_floating_point() else torch.float32)
            if key is not None:
                cache[key] = p
        mom = v.moment.to(p.dtype)
        m, n = shape
        if side == "right":
            if mom.shape[0] != m or p.shape != (mom.shape[1], n):
                raise ValueError(f"view {i}: right-side moment must be (m × r) with basis (r × n)")
            pairs.append((mom, p.T))
        else:
            if mom.shape[1] != n or p.shape != (m, mom.shape[0]):
                raise ValueError(f"view {i}: left-side moment must be (r × n) with basis (m × r)")
            pairs.append((mom.T, p))
    return pairs, side


def synchronize_moments(
    views: Sequence[MomentView],
    weights: Sequence[float],
    mode: str,
    joint_rank: Union[int, str, None] = None,
    center: bool = True,
    seed: int = 0,
    **ajive_options,
) -> SyncResult:
    """Second-moment synchronisation of Algorithm 1, line 12 (paper §5, eq. "matrix view"):
    ``v̄ = S({V_i}, {p_i})`` with ``V_i = v_i P_i`` (right) / ``P_i v_i`` (left); for ``ajive``
    ``v̄ = Σ_i p_i (μ_i + J_i)``. Views may share one (seeded) basis or each have their own.
    ``joint_rank``: int, ``"auto"`` (ajive only) or ``None`` (= the view rank ``r``, the paper's
    ``k = r``). Returns ``state`` as ``Factored`` of the full ``m × n`` matrix."""
    pairs, side = _pairs_from_views(views)
    res = synchronize(pairs, weights, mode, joint_rank, center, seed, **ajive_options)
    if res.state is not None and side == "left":
        s = res.state
        res.state = Factored(s.right, s.core.T, s.left)
    return res


def project_moment(state: Factored, basis: torch.Tensor, side: str, clamp: bool = True) -> torch.Tensor:
    """A client's warm-start second moment from the broadcast state: ``v = v̄ Pᵀ`` (right side,
    ``m × r``) or ``Pᵀ v̄`` (left side, ``r × n``), clamped at 0 (DESIGN §3.2), on factors."""
    basis = basis.to(state.left.dtype)
    if side == "right":
        v = (state.left @ state.core) @ (state.right.T @ basis.T)
    elif side == "left":
        v = (basis.T @ state.left) @ (state.core @ state.right.T)
    else:
        raise ValueError(f"unknown side {side!r}")
    return v.clamp_min(0) if clamp else v
