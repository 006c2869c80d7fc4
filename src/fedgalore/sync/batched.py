"""The second-moment sync ``S`` of many matrices at once (the round's overhead, benchmarks/RESULTS.md §9.2).

:func:`fedgalore.sync.moments.synchronize_moments` is the reference: one adapted matrix, its
``K`` clients' rank-``r`` views, AJIVE on factors (paper §5, Algorithm 1 lines 12–13; Appendix F).
A model has hundreds of adapted matrices but only a handful of distinct shapes (SmolLM2-135M:
210 matrices, 3 shapes × 2 sides), and at rank 8 every step of ``S`` on one matrix is a small
LAPACK call or a small product: per matrix, Python and dispatch cost more than the arithmetic
(about 3–4 ms a matrix). :func:`synchronize_moments_many` runs ``S`` on every matrix of one round
and, for the matrices that share a shape, runs the same equations as the reference on stacked
tensors — one batched QR, SVD, eigendecomposition or product per step for the whole group:

1. shared basis ``B`` (the views' seeded basis, or the consensus basis: top-``r`` right (left)
   singular vectors of ``[√p_i P_i]_i``, signed so each vector's largest entry is positive) and
   the views moved onto it by the squared rule (:mod:`fedgalore.sync.moments`' module doc);
2. AJIVE with ``center`` on the factored views ``X_i = A_i Bᵀ``: ``l̄_i`` = row mean of ``A_i``,
   ``μ_i = B l̄_i``; thin SVD of ``(A_i − 1 l̄_iᵀ) Bᵀ`` from QRs of both factors; signal rank
   ``r``, threshold ``τ_i = D_i[r]/2``; the views' evidence weights ``ω_i`` (``p_i`` times the
   view's mean evidence, mean 1; ones without evidence); ``M = [√ω_1 U_1 … √ω_K U_K]``, its thin
   QR and the SVD of ``R`` (candidates ``u_j = Q u_R,j``; σ at rounding level are none);
   identifiability ``‖X_iᵀ u_j‖ ≥ τ_i min(1, ω_i)`` for every ``i``;
3. ``v̄ = L Ā``, the joint projection of the evidence-pooled estimate, returned as coordinates on
   ``B`` with weights ``Σ_i p_i c_i``; a matrix whose state is not finite gets the pooled ``Ā``
   itself (``ajive_fallback = 1``), as the reference does.

Every decision the reference takes per matrix is taken per matrix inside the batch: a view of
numerical rank ``c_i < r`` keeps ``c_i`` columns (the rest are zero columns of ``M``: singular
values 0, never candidates), the joint rank is lowered to the
available directions, and the components the identifiability check drops become zero columns
placed after the kept ones (the final QRs' leading blocks are the reference's; the zero block
adds nothing to the state) — with the reference's warnings, one per matrix. A matrix with a zero
view, or with non-finite input, is recomputed by the reference function, as is every matrix
outside the batched case (mode other than ``ajive``, ``joint_rank = "auto"``, ``center=False``,
extra AJIVE options, ``K = 1``, mixed ranks or weights, few rows: ``rows ≤ 2 K r``, ``K r ≥
512``, or a shape no other matrix has). So the states are the reference's up to float rounding
(batched and single products round differently; tests/sync/test_sync_batched.py holds them to 1e-4
relative and the ranks to equality), and ``batched=False`` gives the reference exactly. A
decision can differ only where the reference's own margin is at rounding level: on three
captured SmolLM2 rounds (630 matrix syncs), two joint ranks differed by one, and in both the
reference itself flips under 1e-6 relative noise on its input.

The mismatch diagnostics (``diagnostics=True``) are batched as well, in the reference's closed
form on the shared basis (:func:`_mismatch`); a basis that is not orthonormal takes the
reference's Cholesky form, per matrix. Measured by ``benchmarks/sync_per_matrix.py`` (both
paths, interleaved).
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Sequence, Union

import torch

from fedgalore.protocol import second_moment as sm
from fedgalore.protocol.payload import MomentView
from fedgalore.sync.ajive import all_finite
from fedgalore.sync.moments import (
    SyncResult,
    _check_views,
    _check_weights,
    _orthonormalising,
    _same_basis,
    coordinate_diagnostics,
    joint_projection,
    numerical_rank,
    synchronize_moments,
    top_singular_basis,
)

__all__ = ["synchronize_moments_many"]

#: joint spaces this wide take AJIVE's iterative SVD (``joint_svd="auto"``): left to the reference
_ITERATIVE_WIDTH = 512


def synchronize_moments_many(
    items: Sequence[Sequence[MomentView]],
    weights: Sequence[float],
    mode: str,
    joint_rank: Union[int, str, None] = None,
    center: bool = True,
    seeds: Sequence[int] | None = None,
    diagnostics: bool = True,
    batched: bool = True,
    **ajive_options,
) -> list[SyncResult]:
    """``S`` (Algorithm 1, lines 12–13) for every matrix of a round: ``items[j]`` are the ``K``
    clients' views of matrix ``j`` (in the order of ``weights``), ``seeds[j]`` its AJIVE seed.
    Returns one :class:`~fedgalore.sync.moments.SyncResult` per item, equal to
    ``synchronize_moments(items[j], weights, mode, joint_rank, center, seeds[j], diagnostics)``
    up to float rounding (module doc); with ``batched=False`` it *is* that call. Batched items
    report ``time_s`` as their share of their group's wall time."""
    seeds = list(seeds) if seeds is not None else [0] * len(items)
    if len(seeds) != len(items):
        raise ValueError(f"got {len(seeds)} seeds for {len(items)} matrices")
    out: list[SyncResult | None] = [None] * len(items)
    groups: dict[tuple, list[int]] = {}
    if batched and _batchable_call(mode, joint_rank, center, ajive_options):
        for j, views in enumerate(items):
            key = _signature(views)
            if key is not None:
                groups.setdefault(key, []).append(j)
    for key, idx in groups.items():
        if len(idx) < 2:
            continue
        for j in idx:
            _check_views(items[j])  # the reference's errors, before anything is computed
        p = _check_weights(weights, key[2])
        done = _sync_group([items[j] for j in idx], p, key, joint_rank, diagnostics)
        for j, res in zip(idx, done):
            out[j] = res
    for j, views in enumerate(items):
        if out[j] is None:
            out[j] = synchronize_moments(views, weights, mode, joint_rank, center, seeds[j], diagnostics, **ajive_options)
    return out  # type: ignore[return-value]


def _batchable_call(mode: str, joint_rank, center: bool, ajive_options: dict) -> bool:
    return mode == "ajive" and center and not ajive_options and (joint_rank is None or (isinstance(joint_rank, int) and joint_rank >= 0))


def _signature(views: Sequence[MomentView]) -> tuple | None:
    """The group key of one matrix's views, or None when it takes the reference path."""
    if len(views) < 2:
        return None
    first = views[0]
    if first.side not in ("right", "left") or not first.moment.is_floating_point():
        return None
    r = first.rank
    m, n = first.shape
    rows, d = (m, n) if first.side == "right" else (n, m)
    k = len(views)
    if r < 1 or rows <= 2 * k * r or k * r >= _ITERATIVE_WIDTH or r > min(rows, d) - 1:
        return None
    try:
        ok = all(v.side == first.side and tuple(v.shape) == (m, n) and v.rank == r and v.moment.dtype == first.moment.dtype
                 and v.moment.device == first.moment.device for v in views)
    except (AttributeError, IndexError):
        return None
    if not ok:
        return None
    has_weight = all(v.weight is not None for v in views)
    if not has_weight and any(v.weight is not None for v in views):
        return None  # mixed: the reference drops the weights, as it does
    same = _same_basis(views)
    return (first.side, (m, n), k, r, first.moment.dtype, str(first.moment.device), has_weight, same)


def _sync_group(group: list[Sequence[MomentView]], p: torch.Tensor, key: tuple, joint_rank, diagnostics: bool) -> list[SyncResult | None]:
    """One shape group, batched; ``None`` for a matrix the reference must redo (module doc)."""
    t0 = time.perf_counter()
    side, shape, K, r, dtype, _, has_weight, same = key
    G = len(group)
    pw = [float(x) for x in p]
    dev = group[0][0].moment.device

    def basis_of(v: MomentView) -> torch.Tensor:
        raw = v.basis if v.basis is not None else v.basis_matrix()
        return raw.to(device=dev, dtype=dtype)

    moms = torch.stack([torch.stack([v.moment.to(dtype) for v in views]) for views in group])  # G × K × (m×r | r×n)
    wts = torch.stack([torch.stack([v.weight.to(dtype) for v in views]) for views in group]) if has_weight else None
    if not all_finite(moms) or (wts is not None and not all_finite(wts)):
        return [None] * G  # the reference names the view
    evid = None if wts is None else wts.unsqueeze(-2)  # G × K × 1 × r (rows × r orientation)
    if same:
        basis = torch.stack([basis_of(views[0]) for views in group])  # G × (r×n | m×r)
        out_basis = [views[0].basis for views in group]
        out_seed = [None if views[0].basis is not None else views[0].seed for views in group]
        overlap = [1.0] * G
    else:
        own = torch.stack([torch.stack([basis_of(v) for v in views]) for views in group])  # G × K × (r×n | m×r)
        if not all_finite(own):
            return [None] * G
        basis = _consensus_basis(own, pw, r, side)
        out_basis = [b.clone() for b in basis.unbind(0)]  # each state owns its memory (not a slice of the batch)
        out_seed = [None] * G
        # the squared rule: C_i = P_i Bᵀ (right) / Bᵀ P_i (left), coordinates move with C∘C
        c = own @ basis.transpose(-1, -2).unsqueeze(1) if side == "right" else basis.transpose(-1, -2).unsqueeze(1) @ own
        c2 = c * c  # G × K × r × r
        w = wts if has_weight else torch.ones(G, K, r, dtype=dtype, device=dev)
        ev = w.unsqueeze(-2) if side == "right" else w.unsqueeze(-1)  # G × K × (1×r | r×1)
        acc, ev = sm.move(moms.clamp(min=0) * ev, ev, c, side, "squared")  # the reference's rule, batched
        moms = sm.estimate(acc, ev)
        wts = ev.flatten(-2) if has_weight else None
        evid = ev if side == "right" else ev.transpose(-1, -2)  # G × K × 1 × r: pooled by evidence
        ov = c2.sum(dim=(-2, -1)).double() / r  # G × K
        overlap = [sum(pi * float(o) for pi, o in zip(pw, row)) for row in ov.cpu()]
    # factored views X_i = A_i Rᵀ: rows = m (right side) or n (left side)
    a = moms if side == "right" else moms.transpose(-1, -2)  # G × K × rows × r
    right = basis.transpose(-1, -2) if side == "right" else basis  # G × d × r
    if not (all_finite(a) and all_finite(right)):
        return [None] * G  # the reference names the view
    rows, d = a.shape[-2], right.shape[-2]
    jr = r if joint_rank is None else int(joint_rank)

    # Phase 1: centring folded into the left factor, thin SVD from the factors' QRs, numerical
    # rank c_i of every view (the signal rank r is lowered to it: columns beyond c_i are zeroed)
    ones = torch.ones(rows, dtype=dtype, device=dev)
    lbar = (a.transpose(-1, -2) @ ones) / rows  # G × K × r
    mu = (right.unsqueeze(1) @ lbar.unsqueeze(-1)).squeeze(-1)  # G × K × d
    ql, rl = torch.linalg.qr(a - lbar.unsqueeze(-2))
    qb, rb = torch.linalg.qr(right)
    u, s64, wt = torch.linalg.svd(rl.double() @ rb.double().transpose(-1, -2).unsqueeze(1), full_matrices=False)
    tol = 10 * max(rows, d) * torch.finfo(dtype).eps
    ranks = (s64 > tol * s64[..., :1]).sum(dim=-1) * (s64[..., 0] > 0)  # G × K
    live = torch.arange(r, device=dev) < ranks.unsqueeze(-1)  # G × K × r: the first c_i columns
    U = (ql @ u.to(dtype)) * live.unsqueeze(-2)  # G × K × rows × r
    V = qb.unsqueeze(1) @ wt.transpose(-1, -2).to(dtype)  # G × K × d × r
    sv = s64.to(dtype) * live  # G × K × r
    tau = torch.gather(sv, -1, (ranks - 1).clamp_min(0).unsqueeze(-1)).squeeze(-1).double() / 2  # (D[c] + 0) / 2
    regular = (ranks >= 1).all(dim=-1)  # a zero view takes no part in the joint space: the reference's case
    for g, row in enumerate(ranks.tolist()):  # the reference's warnings, per matrix and view
        for i, c in enumerate(row):
            if 0 < c < r:
                warnings.warn(f"view {i}: signal rank {r} exceeds the view's numerical rank {c}; using {c}", RuntimeWarning)

    # Phase 2: M = [√ω_1 U_1 … √ω_K U_K] (zero columns beyond each c_i; ω_i the views' evidence weights,
    # 1 without evidence), its thin QR M = Q R and the SVD of R: U_M = Q U_R, Mᵀ U_M = V_R S (descending σ)
    omega = _omega(None if evid is None else evid.flatten(-2), pw, ranks, dtype)  # G × K, mean 1 (the reference's normalisation)
    root = omega.sqrt()
    M = (U * root[..., None, None]).transpose(1, 2).reshape(G, rows, K * r)
    q, rr = torch.linalg.qr(M)
    u_r, svals, vh_r = torch.linalg.svd(rr.double(), full_matrices=False)  # G × Kr × Kr, G × Kr
    s_tot = (ranks * (omega > 0)).sum(dim=-1)  # G: the reference's Σ r_k over its active views
    rounding = 10 * torch.maximum(s_tot, torch.full_like(s_tot, rows)).double() * torch.finfo(dtype).eps * svals[..., 0]
    avail = (svals > rounding.unsqueeze(-1)).sum(dim=-1)  # G: σ above rounding level
    j0 = avail.clamp(max=jr)
    for g in range(G):
        if bool(regular[g]) and int(avail[g]) < jr:
            warnings.warn(f"joint rank {jr} exceeds the {int(avail[g])} available joint directions; using {int(avail[g])}", RuntimeWarning)
    jmax = min(jr, K * r)
    cand = torch.arange(jmax, device=dev) < j0.unsqueeze(-1)  # G × jmax
    u_cand = (q @ u_r[..., :jmax].to(dtype)) * cand.unsqueeze(-2)  # G × rows × jmax
    mtu = (vh_r[..., :jmax, :].transpose(-1, -2) * svals[..., None, :jmax]).to(dtype)  # G × Kr × jmax: √ω_i U_iᵀ u_j
    mtu = (mtu.reshape(G, K, r, jmax) / torch.where(root > 0, root, 1.0)[..., None, None]) * cand[:, None, None, :]
    # identifiability: drop u_j when ‖X_iᵀ u_j‖ < τ_i min(1, ω_i) for any view i
    norms = (sv.unsqueeze(-1) * mtu).norm(dim=-2)  # G × K × jmax
    thr = tau * omega.double().clamp(max=1.0)
    kept = cand & ~(norms.double() < thr.unsqueeze(-1)).any(dim=1)  # G × jmax

    # Phase 3 + the state: v̄ = L Ā, the joint projection of the evidence-pooled estimate
    # (moments.synchronize_moments); the kept components first, the dropped ones as zero columns
    perm = torch.sort((~kept).to(torch.uint8), dim=-1, stable=True).indices  # G × jmax
    keptf = torch.gather(kept, -1, perm).to(dtype)
    uj = torch.gather(u_cand, -1, perm.unsqueeze(1).expand(-1, rows, -1)) * keptf.unsqueeze(1)
    pooled, _ = sm.pool([a[:, i] for i in range(K)], None if evid is None else [evid[:, i] for i in range(K)], pw)
    coords = joint_projection(pooled, uj, True)  # G × rows × r, coordinates on B
    # a degenerate matrix (non-finite state) falls back to the evidence-pooled mean, as the reference does
    fell = ~torch.isfinite(coords).flatten(1).all(dim=-1)  # G
    if bool(fell.any()):
        coords = torch.where(fell[:, None, None], pooled, coords)
    orthonormal = _orthonormal(right)
    keep = numerical_rank(coords, max(rows, d))
    for g in range(G):
        if not orthonormal[g]:  # the rank of the full matrix X̄ Bᵀ: the reference's route
            keep[g] = numerical_rank(coords[g] @ _orthonormalising(right[g]), max(rows, d))
    wbar = sum(pw[i] * wts[:, i] for i in range(K)) if wts is not None else None
    n_kept = kept.sum(dim=-1)
    mismatch = _mismatch(a, pooled, coords, pw, orthonormal) if diagnostics else None
    t_each = (time.perf_counter() - t0) / G
    results: list[SyncResult | None] = []
    for g in range(G):
        if not bool(regular[g]):
            results.append(None)
            continue
        t1 = time.perf_counter()
        c = int(keep[g])
        co = coords[g] if side == "right" else coords[g].T
        diag = {"n_views": float(K), "joint_rank": float(c if bool(fell[g]) else n_kept[g]), "state_rank": float(c)}
        if mismatch is not None and g in mismatch:
            diag.update(mismatch[g])
        elif diagnostics:  # a basis that is not orthonormal: the reference's form with its Cholesky factor
            diag.update(coordinate_diagnostics([a[g, i] for i in range(K)], right[g], pw, pooled[g], coords[g]))
        diag["basis_overlap"] = overlap[g]
        diag["ajive_fallback"] = float(bool(fell[g]))
        diag["time_s"] = t_each + time.perf_counter() - t1
        view = MomentView(co.clone(memory_format=torch.contiguous_format), side, shape, out_basis[g], out_seed[g],
                          None if wbar is None else wbar[g].clone())
        results.append(SyncResult(view, diag))
    return results


def _mismatch(a: torch.Tensor, pooled: torch.Tensor, coords: torch.Tensor, pw: list[float],
              orthonormal: list[bool]) -> dict[int, dict[str, float]]:
    """:func:`fedgalore.sync.moments.coordinate_diagnostics` for every matrix whose basis is
    orthonormal (``‖X Bᵀ‖_F = ‖X‖_F``), batched: views ``a`` (``G × K × rows × r``), the pooled
    estimate ``Ā`` and the state ``X̄`` (``G × rows × r``); ``mismatch_before = Σ_i p_i ‖A_i − Ā‖
    / ‖Ā‖``, ``mismatch_after = Σ_i p_i ‖A_i − X̄‖ / ‖X̄‖``, ``removed_fraction = ‖Ā − X̄‖ / ‖Ā‖``
    (0 for a zero denominator). Matrices whose basis is not orthonormal are left out (the caller
    takes the reference's form)."""
    fro = lambda x: x.norm(dim=(-2, -1)).double()  # noqa: E731
    mean, xnorm = fro(pooled), fro(coords)
    dev_before = sum(w * fro(a[:, i] - pooled) for i, w in enumerate(pw))
    dev_after = sum(w * fro(a[:, i] - coords) for i, w in enumerate(pw))
    removed = fro(pooled - coords)
    ratio = lambda num, den: num / den if den > 0.0 else 0.0  # noqa: E731
    out = {}
    for g, (ok, m_, x_, b_, a_, r_) in enumerate(zip(orthonormal, mean.tolist(), xnorm.tolist(), dev_before.tolist(),
                                                    dev_after.tolist(), removed.tolist())):
        if ok:
            out[g] = {"mismatch_before": ratio(b_, m_), "mismatch_after": ratio(a_, x_), "removed_fraction": ratio(r_, m_)}
    return out


def _omega(wts: torch.Tensor | None, pw: list[float], ranks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """AJIVE's view weights for every matrix (``G × K``), as the reference computes them
    (:func:`fedgalore.sync.moments.evidence_weights` and :func:`fedgalore.sync.ajive.ajive`'s
    ``view_weights``) from the evidence the pooling uses (``wts``: ``G × K × r``): ``w_i = p_i
    mean_j c_ij`` normalised to mean 1 over the views with ``w_i > 0``; ones without evidence (or
    when no view has any)."""
    G, K = ranks.shape
    if wts is None:
        return torch.ones(G, K, dtype=dtype, device=ranks.device)
    p = torch.tensor(pw, dtype=torch.float64, device=wts.device)
    w = wts.double().mean(dim=-1) * p  # G × K
    total = w.sum(dim=-1, keepdim=True)
    pos = (w > 0).sum(dim=-1, keepdim=True).double()
    om = torch.where(total > 0, pos * w / total.clamp_min(1e-300), torch.ones_like(w))
    return om.to(dtype)


def _orthonormal(right: torch.Tensor) -> list[bool]:
    """Per matrix of the stack ``right`` (``G × d × r``): whether its columns are orthonormal."""
    btb = right.double().transpose(-1, -2) @ right.double()
    eye = torch.eye(btb.shape[-1], dtype=torch.float64, device=btb.device)
    return ((btb - eye).abs().amax(dim=(-2, -1)) < 1e-6).tolist()


def _consensus_basis(own: torch.Tensor, pw: list[float], rank: int, side: str) -> torch.Tensor:
    """:func:`fedgalore.sync.moments.consensus_basis` for ``G`` matrices at once: ``own`` is
    ``G × K × (r×n)`` (right) or ``G × K × (m×r)`` (left); returns ``G × rank × n`` / ``G × m × rank``."""
    scale = torch.tensor([math.sqrt(w) for w in pw], dtype=torch.float64, device=own.device)
    cols = own.double() * scale[None, :, None, None]
    cols = cols.transpose(-1, -2) if side == "right" else cols  # G × K × rows × r
    G, K, rows, r = cols.shape
    return top_singular_basis(cols.transpose(1, 2).reshape(G, rows, K * r), rank, side, own.dtype)
