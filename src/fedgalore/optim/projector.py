"""Projector bases for GaLore-style optimisers (paper App. B "Details of GaLore-AdamW", App. E).

A rank-``r`` basis for a weight ``W (m x n)`` lives on one side:

* ``right``: ``P (r x n)`` with orthonormal rows; projection ``R = G P^T (m x r)``, back-projection
  ``U P (m x n)``.
* ``left``:  ``P (m x r)`` with orthonormal columns; projection ``R = P^T G (r x n)``, back-projection
  ``P U (m x n)``.

Orientation follows the official GaLore ``proj_type`` table (reference/algorithms.md §1.1):
``std`` projects the smaller dimension (right when ``m >= n``), ``reverse_std`` the larger one,
``left``/``right`` are explicit. It is resolved once (:func:`resolve_side`) and stored, which
avoids the official ``reverse_std`` back-projection shape bug.

Data-driven bases: exact thin SVD (:func:`svd_basis`) and randomised SVD with a local generator
(:func:`rsvd_basis`, Halko et al. 2011 Alg. 4.4 + 5.1). Seeded Haar-orthonormal bases and their
seeds live with the wire types (:mod:`fedgalore.protocol.bases`), since a payload carries a seed
in place of such a basis.

Nothing here touches a global RNG.
"""
from __future__ import annotations

import torch

from fedgalore.protocol.bases import change_of_basis  # the one change of basis, shared with sync

__all__ = [
    "PROJ_TYPES",
    "resolve_side",
    "svd_basis",
    "rsvd_basis",
    "change_of_basis",
    "project",
    "project_back",
]

PROJ_TYPES = ("std", "reverse_std", "left", "right")


def resolve_side(shape: tuple[int, int], proj_type: str) -> str:
    """Side of the basis for a ``(m, n)`` weight under ``proj_type`` (reference §1.1 table).

    ``std``: right if ``m >= n`` else left; ``reverse_std``: left if ``m >= n`` else right;
    ``left`` / ``right``: as named.
    """
    m, n = shape
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    if proj_type in ("left", "right"):
        return proj_type
    raise ValueError(f"unknown proj_type {proj_type!r}; expected one of {PROJ_TYPES}")


def svd_basis(g: torch.Tensor, rank: int, side: str) -> torch.Tensor:
    """Top-``rank`` singular basis of ``g`` from a full thin SVD in fp32 (official GaLore).

    ``G = U diag(s) V^T``; right: ``P = V^T[:rank]`` (rank x n); left: ``P = U[:, :rank]`` (m x rank).
    """
    u, _, vh = torch.linalg.svd(g.float(), full_matrices=False)
    return vh[:rank].contiguous() if side == "right" else u[:, :rank].contiguous()


def _range_finder_left(a: torch.Tensor, rank: int, gen: torch.Generator, oversample: int, niter: int) -> torch.Tensor:
    """Top-``rank`` left singular vectors of ``a (m x n)`` by randomised SVD (Halko et al. 2011).

    ``Omega ~ N(0,1)^{n x l}`` (``l = rank + oversample``, drawn on CPU ``gen``),
    ``Q = orth(A Omega)``; ``niter`` power iterations ``Q <- orth(A orth(A^T Q))``;
    ``B = Q^T A``, ``B = U_B S V_B^T``, return ``(Q U_B)[:, :rank]``.
    """
    m, n = a.shape
    ell = min(rank + oversample, m, n)
    omega = torch.randn(n, ell, generator=gen, dtype=torch.float32, device="cpu").to(a.device)
    q, _ = torch.linalg.qr(a @ omega)
    for _ in range(niter):
        z, _ = torch.linalg.qr(a.T @ q)
        q, _ = torch.linalg.qr(a @ z)
    b = q.T @ a  # (l x n)
    ub, _, _ = torch.linalg.svd(b, full_matrices=False)
    return q @ ub[:, :rank]


def rsvd_basis(
    g: torch.Tensor, rank: int, side: str, seed: int, oversample: int = 8, niter: int = 2
) -> torch.Tensor:
    """Randomised-SVD basis of ``g`` in fp32 with a local generator seeded by ``seed``.

    Approximates :func:`svd_basis` (Halko et al. 2011, Alg. 4.4 range finder with ``niter``
    power iterations + Alg. 5.1). Left side works on ``G``; right side on ``G^T`` and transposes:
    right ``P = (left basis of G^T)^T``. The Gaussian test matrix is drawn on a CPU
    ``torch.Generator`` (``torch.svd_lowrank`` would use the global RNG), so the result is
    deterministic given ``(g, seed)``.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    a = g.float()
    if side == "right":
        return _range_finder_left(a.T, rank, gen, oversample, niter).T.contiguous()
    return _range_finder_left(a, rank, gen, oversample, niter).contiguous()


def project(g: torch.Tensor, p: torch.Tensor, side: str) -> torch.Tensor:
    """``R = G P^T`` (right) or ``R = P^T G`` (left)."""
    return g @ p.T if side == "right" else p.T @ g


def project_back(u: torch.Tensor, p: torch.Tensor, side: str) -> torch.Tensor:
    """``U P`` (right) or ``P U`` (left)."""
    return u @ p if side == "right" else p @ u
