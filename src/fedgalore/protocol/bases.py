"""Seeded bases: what a basis seed on the wire stands for (paper App. E, Alg. 1 line 13).

A rank-``r`` basis for a weight ``W (m x n)`` lives on one side: ``right`` — ``P (r x n)`` with
orthonormal rows; ``left`` — ``P (m x r)`` with orthonormal columns. A *seeded* basis is a Haar
(uniformly random) orthonormal frame drawn from an integer seed on a CPU generator, so a seed is
all a payload needs to carry and every process and device rebuilds the same bits
(:func:`seeded_basis`). Seeds come from ``(round seed s_k, parameter name, refresh index)`` by
SHA-256 (:func:`basis_seed`; docs/design.md §3.1 "Seeds").

Nothing here touches a global RNG.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import torch

__all__ = ["SIDES", "basis_seed", "seeded_basis", "frame_of", "padded_sum", "change_of_basis"]

SIDES = ("right", "left")
_SEED_MASK = (1 << 63) - 1

#: Bytes of recently drawn seeded bases kept per process (least recently used dropped first). One
#: round rebuilds the same basis in every client and again in the server's sync and downlink; a
#: draw is a float64 QR of ``d x r`` (about 0.3 ms at 1536 x 8), a cache hit a copy. 0 disables.
BASIS_CACHE_BYTES = 64 << 20
_cache: "OrderedDict[tuple[int, int, int], torch.Tensor]" = OrderedDict()
_cache_bytes = 0
_cache_lock = threading.Lock()


def basis_seed(round_seed: int, param_key: str, refresh_index: int) -> int:
    """Stable seed for the basis of parameter ``param_key`` at refresh ``refresh_index``.

    ``seed = int64(SHA-256("fedgalore|round_seed|param_key|refresh_index")[:8]) mod 2^63``
    (docs/design.md §3.1 "Seeds"; paper Alg. 1, projection seed ``s_k``). Uses :mod:`hashlib`, not
    Python's salted ``hash()``, so every process and machine derives the same integer.
    Result lies in ``[0, 2**63)``.
    """
    if isinstance(round_seed, bool) or not isinstance(round_seed, int):
        raise TypeError(f"round_seed must be an int, got {type(round_seed).__name__}")
    if isinstance(refresh_index, bool) or not isinstance(refresh_index, int) or refresh_index < 0:
        raise ValueError(f"refresh_index must be a non-negative int, got {refresh_index!r}")
    msg = f"fedgalore|{int(round_seed)}|{param_key}|{int(refresh_index)}".encode()
    digest = hashlib.sha256(msg).digest()
    return int.from_bytes(digest[:8], "little") & _SEED_MASK


def _haar(seed: int, d: int, rank: int) -> torch.Tensor:
    """``Q (d x rank)`` Haar-distributed on the Stiefel manifold, float64, from a CPU generator.

    ``Z ~ N(0,1)^{d x r}`` (float64), ``Z = Q R``, ``Q <- Q diag(sign(diag R))`` (Mezzadri's sign
    fix, which makes the distribution exactly Haar; reference/algorithms.md §2.6(a)).
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    z = torch.randn(d, rank, generator=gen, dtype=torch.float64, device="cpu")
    q, r = torch.linalg.qr(z, mode="reduced")
    sign = torch.sign(torch.diagonal(r))
    sign[sign == 0] = 1.0
    return q * sign


def seeded_basis(seed: int, m: int, n: int, rank: int, side: str, frame: int | None = None) -> torch.Tensor:
    """Seeded Haar-orthonormal basis for an ``m x n`` weight (paper App. E, seeded projectors).

    ``side="right"``: ``P = Q^T`` of shape ``(rank, n)``, orthonormal rows (``P P^T = I``).
    ``side="left"``:  ``P = Q`` of shape ``(m, rank)``, orthonormal columns (``P^T P = I``).
    ``Q`` is drawn by :func:`_haar` in float64 on a CPU ``torch.Generator`` seeded with ``seed``
    and cast to float32; the result is always a float32 CPU tensor, identical on every machine.

    ``frame`` (sites at different ranks, docs/design.md "A rank per site"): the basis is the
    leading ``rank`` vectors of the seed's rank-``frame`` frame, ``Q_frame[:, :rank]``, so a
    site at rank ``r`` and a site at rank ``r' > r`` share their first ``r`` basis vectors
    exactly (nested seeded bases). ``None`` or ``frame == rank``: the seed's own rank-``rank``
    draw, as before (a rank-``r`` draw is *not* the leading block of a larger one: the Gaussian
    is filled row by row).
    """
    if side not in SIDES:
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    d = n if side == "right" else m
    if rank <= 0 or rank > d:
        raise ValueError(f"rank must be in [1, {d}] for side {side!r} of a {m}x{n} matrix, got {rank}")
    if frame is not None and frame != rank:
        if frame < rank or frame > d:
            raise ValueError(f"frame must be in [rank={rank}, {d}] for side {side!r} of a {m}x{n} matrix, got {frame}")
        q = _cached_haar32(int(seed), d, int(frame))[:, :rank]
    else:
        q = _cached_haar32(int(seed), d, rank)
    return (q.T if side == "right" else q).clone(memory_format=torch.contiguous_format)


def frame_of(rank: int, frame: int | None) -> int | None:
    """The ``frame`` a rank-``rank`` term or view records: ``None`` when it is its own rank's
    draw (the wire format then carries no frame: uniform-rank runs are unchanged)."""
    return None if frame is None or int(frame) == int(rank) else int(frame)


def _cached_haar32(seed: int, d: int, rank: int) -> torch.Tensor:
    """``_haar(seed, d, rank)`` as float32, through the per-process LRU cache of
    :data:`BASIS_CACHE_BYTES` (callers get copies; the cached tensor is never handed out)."""
    global _cache_bytes
    key = (seed, d, rank)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    q = _haar(seed, d, rank).to(torch.float32)
    size = q.numel() * q.element_size()
    if size <= BASIS_CACHE_BYTES:
        with _cache_lock:
            if key not in _cache:
                _cache[key] = q
                _cache_bytes += size
            while _cache_bytes > BASIS_CACHE_BYTES and _cache:
                _, old = _cache.popitem(last=False)
                _cache_bytes -= old.numel() * old.element_size()
    return q


def padded_sum(a: torch.Tensor, b: torch.Tensor, side: str) -> torch.Tensor:
    """``a + b`` of two coefficient blocks on nested seeded bases (one seed and frame, ranks
    ``r_a`` and ``r_b``): the smaller zero-padded to the larger rank — columns on the right side
    (``C`` is ``m × r``), rows on the left (``r × n``). Exact: ``C_a P_{r_a} + C_b P_{r_b} =
    (pad(C_a) + pad(C_b)) P_{max}`` because ``P_r`` is the leading block of ``P_max``."""
    dim = 1 if side == "right" else 0
    if a.shape[dim] < b.shape[dim]:
        a, b = b, a
    out = a.clone()
    if dim == 1:
        out[:, : b.shape[1]] += b
    else:
        out[: b.shape[0]] += b
    return out


def change_of_basis(p_old: torch.Tensor, p_new: torch.Tensor, side: str) -> torch.Tensor:
    """``C (r_old x r_new)`` mapping old projected coordinates to new ones (paper App. B "buffer
    reprojection"; docs/design.md §3.1): the one change of basis of the client's refresh
    (:mod:`fedgalore.optim`) and the server's move onto a shared basis (:mod:`fedgalore.sync.moments`).

    Right: ``C = P_old P_new^T`` and ``M_new = M_old C``. Left: ``C = P_new^T P_old`` and
    ``M_new = C M_old``. Exact for the component of ``M`` lifted to the full space that lies in
    ``span(P_new)``; the rest is dropped.
    """
    return p_old @ p_new.T if side == "right" else p_new.T @ p_old
