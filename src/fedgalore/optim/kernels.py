"""The GEMMs of a GaLore step and the probes that choose them (split out of
:mod:`fedgalore.optim.galore_adamw`; paper App. B: ``R = G Pᵀ`` / ``Pᵀ G`` and ``W ← d W + coef U P``
/ ``d W + coef P U``).

Per matrix: :func:`project_step` (AVX2 kernel, oneDNN or ``torch.matmul``, chosen by shape and
device) and :func:`decay_back_project` (one read and write of ``W``). Per bucket of matrices of one
shape (:func:`project_stacked`, :func:`decay_back_project_stacked`): one ``bmm`` each for the
projection and the back-projection of ``B`` matrices, the weights updated by two multi-tensor
(``torch._foreach_*``) kernels — ``B`` launches fewer per op, the GPU's form (module doc of
:mod:`fedgalore.optim.bucket`).

A normal (non-refresh) GaLore step streams ``G`` once (the projection) and ``W`` once (read +
write: decay and back-projection); everything else is ``m × r`` (benchmarks/RESULTS.md §1.1 counts it).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

import fedgalore.optim.cpu_kernels as cpu_kernels
from fedgalore.optim.projector import project
from fedgalore.protocol.bases import SIDES

__all__ = ["ONEDNN_MIN_NUMEL", "BLOCK_BYTES", "project_step", "decay_back_project", "propagates_nonfinite",
           "onednn_linear", "onednn_project", "matmul_propagates", "bmm_propagates", "project_stacked",
           "decay_back_project_stacked", "stack_chunks", "STACK_BYTES"]


#: Projections of at least this many entries go through oneDNN on CPU (when it passes the probe):
#: from 512 x 512 up it was faster than MKL at rank 8 (up to 2.1x at 4096 x 4096); below, MKL was
#: as fast or faster on cache-cold gradients.
ONEDNN_MIN_NUMEL = 1 << 18
#: Decay + back-projection run in row blocks of about this many bytes (one L2's worth), so the
#: GEMM updates rows the decay pass has just brought into cache; 0 turns the blocking off.
BLOCK_BYTES = 1 << 20
_KERNELS: dict[Any, Any] = {}


def onednn_project(op: Callable[..., torch.Tensor], g: torch.Tensor, basis: torch.Tensor, side: str) -> torch.Tensor:
    """``G P^T`` (right) / ``P^T G`` (left) with oneDNN's fp32 ``linear(X, W) = X W^T``."""
    if side == "right":
        return op(g, basis, None, "none", [], "")
    return op(basis.T, g.T, None, "none", [], "")


def propagates_nonfinite(fn: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor], device: torch.device) -> bool:
    """Whether ``fn(G, P, side)`` turns every NaN/Inf entry of ``G`` into a non-finite projection,
    also where the basis entries it multiplies are exactly 0 (IEEE: ``NaN·0 = Inf·0 = NaN``; a
    kernel that skips zero multiplicands would not). Probed at two sizes, both sides."""
    for m, n, r in ((24, 16, 3), (384, 256, 8)):
        for side in SIDES:
            d = n if side == "right" else m
            eye = torch.eye(d, r, device=device)  # zero rows beyond r: a "blind" part of the basis
            basis = eye.T.contiguous() if side == "right" else eye.contiguous()
            for bad in (float("nan"), float("inf"), float("-inf")):
                g = torch.ones(m, n, device=device)
                g[m - 1, n - 1] = bad  # multiplied only by zeros of the basis
                if bool(torch.isfinite(fn(g, basis, side)).all()):
                    return False
    return True


def onednn_linear() -> Optional[Callable[..., torch.Tensor]]:
    """``torch.ops.mkldnn._linear_pointwise`` when it computes ``X W^T`` to fp32 rounding and
    propagates non-finite entries (checked once per process), else ``None``."""
    if "onednn" not in _KERNELS:
        op = None
        try:
            cand = torch.ops.mkldnn._linear_pointwise.default
            if torch.backends.mkldnn.is_available():
                gen = torch.Generator().manual_seed(0)
                g = torch.randn(96, 80, generator=gen)
                ok = propagates_nonfinite(lambda x, b, s: onednn_project(cand, x, b, s), torch.device("cpu"))
                for side, basis in (("right", torch.randn(5, 80, generator=gen)), ("left", torch.randn(96, 5, generator=gen))):
                    ok = ok and torch.allclose(onednn_project(cand, g, basis, side), project(g, basis, side), rtol=1e-5, atol=1e-5)
                op = cand if ok else None
        except Exception:  # op missing or failing in this torch build: plain matmul
            op = None
        _KERNELS["onednn"] = op
    return _KERNELS["onednn"]


def matmul_propagates(device: torch.device) -> bool:
    """Whether ``torch.matmul`` on ``device`` propagates non-finite entries (probed once per type)."""
    key = ("matmul", device.type)
    if key not in _KERNELS:
        _KERNELS[key] = propagates_nonfinite(project, device)
    return _KERNELS[key]


def project_step(g: torch.Tensor, basis: torch.Tensor, side: str) -> tuple[torch.Tensor, bool]:
    """``R = project(G, P, side)`` and whether a finite ``R`` proves ``G`` finite (the kernel used
    propagates NaN/Inf, see :func:`propagates_nonfinite`).

    On CPU, fp32 projections of at least :data:`ONEDNN_MIN_NUMEL` entries use the AVX2 kernels
    of :mod:`fedgalore.optim.cpu_kernels` where they apply (rank 8 or 16, one thread; faster
    than oneDNN at the RoBERTa-base shapes, benchmarks/RESULTS.md §1.1), else oneDNN: for the
    skinny rank-r shapes MKL's sgemm ran 1.5-1.7x slower (benchmarks/RESULTS.md §1.1).
    """
    if g.numel() >= ONEDNN_MIN_NUMEL and cpu_kernels.usable(g, basis):
        return cpu_kernels.project(g, basis, side), True  # probed: NaN/Inf propagate
    if (
        g.device.type == "cpu" and g.dtype == torch.float32 and basis.dtype == torch.float32
        and g.numel() >= ONEDNN_MIN_NUMEL and g.is_contiguous() and basis.is_contiguous()
    ):
        op = onednn_linear()
        if op is not None:
            return onednn_project(op, g, basis, side), True
    return project(g, basis, side), matmul_propagates(g.device)


def decay_back_project(w: torch.Tensor, u: torch.Tensor, basis: Optional[torch.Tensor], side: str, decay: float, coef: float) -> None:
    """``W <- decay W + coef U P`` (right) / ``decay W + coef P U`` (left) / ``decay W + coef U``
    (identity, ``basis is None``), in place: one read and one write of ``W``.

    torch order (decay first, then the update), as :func:`fedgalore.optim.functional._finish` documents.
    ``addmm_``'s ``beta`` would fold the decay into the GEMM, but MKL scales ``C`` in a separate
    pass and measured slower than ``mul_`` + ``addmm_`` (benchmarks/RESULTS.md §1.1); instead, on
    CPU, the two run per row block of :data:`BLOCK_BYTES`, so the GEMM finds its rows in cache —
    or, where :func:`fedgalore.optim.cpu_kernels.usable`, in one AVX2 kernel that scales each row
    of ``W`` and adds its rank-``r`` update while the row is in registers (``coef·u`` formed first).
    """
    if basis is None:
        if decay != 1.0:
            w.mul_(decay)
        w.add_(u, alpha=coef)
        return
    if w.numel() >= ONEDNN_MIN_NUMEL and cpu_kernels.usable(w, basis) and u.dtype == torch.float32:
        cpu_kernels.decay_back_project(w, u, basis, side, decay, coef)  # one AVX2 pass over W
        return
    a, b = (u, basis) if side == "right" else (basis, u)  # W += coef a @ b; rows of W are rows of a
    if decay == 1.0:
        w.addmm_(a, b, alpha=coef)
        return
    m = w.shape[0]
    rows = m if BLOCK_BYTES <= 0 or w.device.type != "cpu" else max(1, BLOCK_BYTES // max(1, w.shape[1] * w.element_size()))
    if rows >= m:
        w.mul_(decay)
        w.addmm_(a, b, alpha=coef)
        return
    for blk, a_blk in zip(w.split(rows), a.split(rows)):
        blk.mul_(decay)
        blk.addmm_(a_blk, b, alpha=coef)




# ------------------------------------------------------------------ a bucket at a time (stacked GEMMs)
#: a stacked projection or back-projection copies ``B`` gradients (and forms ``B`` updates) of
#: ``m × n``; buckets are cut into chunks of at most this many bytes of such a stack
STACK_BYTES = 1 << 28


def _bmm_project(g: torch.Tensor, basis: torch.Tensor, side: str) -> torch.Tensor:
    """``G_i P_iᵀ`` (right, ``P_i`` ``r × n``) / ``P_iᵀ G_i`` (left, ``P_i`` ``m × r``) for stacks ``[B, ...]``."""
    if side == "right":
        return torch.bmm(g, basis.transpose(1, 2))
    return torch.bmm(basis.transpose(1, 2), g)


def bmm_propagates(device: torch.device) -> bool:
    """Whether the stacked projection (``torch.bmm``) on ``device`` propagates non-finite entries
    of ``G`` (:func:`propagates_nonfinite`'s probe; once per device type)."""
    key = ("bmm", device.type)
    if key not in _KERNELS:
        _KERNELS[key] = propagates_nonfinite(lambda g, b, s: _bmm_project(g[None], b[None], s)[0], device)
    return _KERNELS[key]


def project_stacked(gs: Sequence[torch.Tensor], bases: torch.Tensor, side: str) -> tuple[torch.Tensor, bool]:
    """``R_i = G_i P_iᵀ`` (right) / ``P_iᵀ G_i`` (left) for a bucket of ``B`` matrices of one shape
    and side: the gradients stacked (one copy) and one ``bmm`` against the stacked bases ``[B, ...]``;
    ``R`` is ``[B, a, b]``. Also whether a finite ``R`` proves every ``G_i`` finite (:func:`bmm_propagates`)."""
    g = torch.stack(list(gs))
    return _bmm_project(g, bases, side), bmm_propagates(g.device)


def decay_back_project_stacked(ws: Sequence[torch.Tensor], u: torch.Tensor, bases: torch.Tensor, side: str,
                               decays: Sequence[float], coefs: Sequence[float]) -> None:
    """``W_i ← d_i W_i + c_i U_i P_i`` (right) / ``d_i W_i + c_i P_i U_i`` (left) for a bucket, in
    place: ``c_i U_i`` formed on the stack, one ``bmm`` for the ``B`` updates, then one multi-tensor
    multiply (the decays, when any is not 1) and one multi-tensor add into the weights — torch
    order (decay first) as :func:`decay_back_project`, equal to it to fp32 rounding (the coefficient
    multiplies ``U`` before the product instead of the product)."""
    coef = torch.tensor(list(coefs), dtype=u.dtype, device=u.device).view(-1, 1, 1)
    cu = u * coef
    delta = torch.bmm(cu, bases) if side == "right" else torch.bmm(bases, cu)
    ws = list(ws)
    if any(d != 1.0 for d in decays):
        torch._foreach_mul_(ws, [float(d) for d in decays])
    torch._foreach_add_(ws, list(delta.unbind(0)))


def stack_chunks(n: int, numel: int, itemsize: int = 4) -> list[slice]:
    """``n`` matrices of ``numel`` entries cut into chunks whose stack stays within :data:`STACK_BYTES`."""
    per = max(1, STACK_BYTES // max(1, numel * itemsize))
    return [slice(i, min(n, i + per)) for i in range(0, n, per)]
