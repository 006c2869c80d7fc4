"""Projector bases: seeds, seeded Haar bases, SVD/RSVD, orientation, change of basis."""
from __future__ import annotations

import hashlib

import pytest
import torch

from fedgalore.protocol.bases import basis_seed, seeded_basis
from fedgalore.optim.projector import (
    change_of_basis,
    project,
    project_back,
    resolve_side,
    rsvd_basis,
    svd_basis,
)

pytestmark = pytest.mark.isa  # numerically sensitive: make test runs it again with the CPU kernels forced down


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# ----------------------------------------------------------------------------- basis_seed
def test_basis_seed_is_stable_and_in_range():
    # Golden values: a change here changes every seeded basis ever exported.
    assert basis_seed(0, "w", 0) == 5397803624892104648
    assert basis_seed(12345, "layer.0.q.weight", 3) == 6238772657657266681
    digest = hashlib.sha256(b"fedgalore|7|a.b|2").digest()
    assert basis_seed(7, "a.b", 2) == int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    seeds = {basis_seed(s, k, q) for s in range(3) for k in ("a", "b") for q in range(4)}
    assert len(seeds) == 24
    assert all(0 <= s < 2**63 for s in seeds)


def test_basis_seed_rejects_bad_arguments():
    with pytest.raises(ValueError):
        basis_seed(0, "w", -1)
    with pytest.raises(TypeError):
        basis_seed(1.5, "w", 0)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- seeded_basis
@pytest.mark.parametrize("side,m,n,r", [("right", 48, 40, 6), ("left", 30, 70, 5), ("right", 16, 16, 16)])
def test_seeded_basis_orthonormal_shape_dtype(side, m, n, r):
    p = seeded_basis(123, m, n, r, side)
    assert p.dtype == torch.float32 and p.device.type == "cpu"
    if side == "right":
        assert p.shape == (r, n)
        gram = p.double() @ p.double().T
    else:
        assert p.shape == (m, r)
        gram = p.double().T @ p.double()
    assert torch.allclose(gram, torch.eye(r, dtype=torch.float64), atol=1e-5)


def test_seeded_basis_is_the_documented_haar_recipe():
    z = torch.randn(40, 6, generator=_gen(99), dtype=torch.float64)
    q, r = torch.linalg.qr(z)
    q = q * torch.sign(torch.diagonal(r))
    assert torch.equal(seeded_basis(99, 10, 40, 6, "right"), q.float().T.contiguous())
    assert torch.equal(seeded_basis(99, 40, 10, 6, "left"), q.float())
    # positive diagonal of R after the sign fix: Q^T Z has positive diagonal
    assert bool((torch.diagonal(q.T @ z) > 0).all())


def test_seeded_basis_same_seed_same_bits_and_different_seeds_differ():
    a = seeded_basis(basis_seed(5, "w", 0), 64, 32, 4, "right")
    b = seeded_basis(basis_seed(5, "w", 0), 64, 32, 4, "right")
    assert torch.equal(a, b)
    other_param = seeded_basis(basis_seed(5, "v", 0), 64, 32, 4, "right")
    other_refresh = seeded_basis(basis_seed(5, "w", 1), 64, 32, 4, "right")
    other_round = seeded_basis(basis_seed(6, "w", 0), 64, 32, 4, "right")
    for c in (other_param, other_refresh, other_round):
        # independent Haar draws: the subspaces are far apart (||P_a P_c^T||_F^2 ~ r^2/n = 0.5)
        assert (a @ c.T).pow(2).sum().item() < 3.0


def test_seeded_basis_uses_local_cpu_generator_only():
    torch_state = torch.get_rng_state()
    seeded_basis(1, 20, 30, 3, "left")
    rsvd_basis(torch.randn(20, 30, generator=_gen(0)), 3, "left", seed=4)
    assert torch.equal(torch.get_rng_state(), torch_state)
    if torch.cuda.is_available():  # pragma: no cover - only with a GPU
        cuda_state = torch.cuda.get_rng_state()
        rsvd_basis(torch.randn(20, 30, device="cuda"), 3, "left", seed=4)
        assert torch.equal(torch.cuda.get_rng_state(), cuda_state)


def test_seeded_basis_rejects_bad_rank_and_side():
    with pytest.raises(ValueError):
        seeded_basis(0, 10, 5, 6, "right")
    with pytest.raises(ValueError):
        seeded_basis(0, 10, 5, 0, "left")
    with pytest.raises(ValueError):
        seeded_basis(0, 10, 5, 2, "up")


# ----------------------------------------------------------------------------- orientation
def test_resolve_side_table():
    assert resolve_side((64, 32), "std") == "right"
    assert resolve_side((32, 32), "std") == "right"
    assert resolve_side((32, 64), "std") == "left"
    assert resolve_side((64, 32), "reverse_std") == "left"
    assert resolve_side((32, 64), "reverse_std") == "right"
    assert resolve_side((32, 64), "right") == "right"
    assert resolve_side((64, 32), "left") == "left"
    with pytest.raises(ValueError, match="proj_type"):
        resolve_side((4, 4), "full")


# ----------------------------------------------------------------------------- svd / rsvd
def _low_rank_plus_noise(m: int, n: int, k: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g))
    s = torch.linspace(10.0, 5.0, k)
    return (u * s) @ v.T + 0.01 * torch.randn(m, n, generator=g)


@pytest.mark.parametrize("side", ["right", "left"])
def test_svd_basis_captures_top_singular_subspace(side):
    a = _low_rank_plus_noise(60, 40, 4, 1)
    p = svd_basis(a, 4, side)
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    ref = vh[:4] if side == "right" else u[:, :4]
    assert p.shape == ref.shape
    # same subspace: projector difference
    pp = p.T @ p if side == "right" else p @ p.T
    rr = ref.T @ ref if side == "right" else ref @ ref.T
    assert torch.allclose(pp, rr, atol=1e-4)


@pytest.mark.parametrize("side", ["right", "left"])
def test_rsvd_basis_matches_svd_subspace_and_is_deterministic(side):
    a = _low_rank_plus_noise(80, 50, 4, 2)
    p = rsvd_basis(a, 4, side, seed=11)
    ref = svd_basis(a, 4, side)
    assert torch.equal(p, rsvd_basis(a, 4, side, seed=11))
    # orthonormal
    gram = p @ p.T if side == "right" else p.T @ p
    assert torch.allclose(gram, torch.eye(4), atol=1e-5)
    # principal angles ~ 0: ||P ref^T||_F^2 = r when the subspaces coincide
    overlap = (p @ ref.T) if side == "right" else (p.T @ ref)
    assert overlap.pow(2).sum().item() == pytest.approx(4.0, abs=1e-4)
    # captures the energy of the exact truncated SVD
    proj = project_back(project(a, p, side), p, side)
    proj_ref = project_back(project(a, ref, side), ref, side)
    assert proj.norm().item() == pytest.approx(proj_ref.norm().item(), rel=1e-5)


# ----------------------------------------------------------------------------- change of basis
@pytest.mark.parametrize("side", ["right", "left"])
def test_change_of_basis_preserves_component_in_new_span(side):
    m, n, r = 24, 18, 5
    p_old = seeded_basis(1, m, n, r, side)
    p_new = seeded_basis(2, m, n, r, side)
    mom = torch.randn((m, r) if side == "right" else (r, n), generator=_gen(3), dtype=torch.float32)
    c = change_of_basis(p_old, p_new, side)
    moved = mom @ c if side == "right" else c @ mom
    lifted = project_back(mom, p_old, side)  # full-space first moment
    expected = project_back(project(lifted, p_new, side), p_new, side)  # its part in span(P_new)
    assert torch.allclose(project_back(moved, p_new, side), expected, atol=1e-5)
    # same basis: identity map
    c_same = change_of_basis(p_old, p_old, side)
    assert torch.allclose(c_same, torch.eye(r), atol=1e-5)


def test_seeded_basis_cache_hands_out_copies_and_stays_within_its_budget(monkeypatch):
    """The per-process LRU cache of seeded bases: a hit returns the same bits as a fresh draw, a
    caller that writes into its basis does not change the next caller's, and the cache never
    holds more than BASIS_CACHE_BYTES (least recently used dropped first)."""
    from fedgalore.protocol import bases

    monkeypatch.setattr(bases, "BASIS_CACHE_BYTES", 3 * 40 * 6 * 4)  # room for three 40 x 6 bases
    monkeypatch.setattr(bases, "_cache", type(bases._cache)())
    monkeypatch.setattr(bases, "_cache_bytes", 0)
    fresh = {s: bases._haar(s, 40, 6).float() for s in range(5)}
    for side in ("right", "left"):
        for s in range(5):
            p = seeded_basis(s, 40, 40, 6, side)
            ref = fresh[s].T if side == "right" else fresh[s]
            assert torch.equal(p, ref) and p.is_contiguous()
            p.add_(1.0)  # the caller owns its copy
            assert torch.equal(seeded_basis(s, 40, 40, 6, side), ref)
        assert bases._cache_bytes <= bases.BASIS_CACHE_BYTES and len(bases._cache) == 3
        assert list(bases._cache) == [(s, 40, 6) for s in (2, 3, 4)]  # the least recent went first
    one = seeded_basis(7, 1, 40, 1, "right")  # a 1 x 40 transpose is contiguous already: still a copy
    one.zero_()
    assert torch.equal(seeded_basis(7, 1, 40, 1, "right"), bases._haar(7, 40, 1).float().T)
    monkeypatch.setattr(bases, "BASIS_CACHE_BYTES", 0)  # 0 disables the cache
    assert torch.equal(seeded_basis(9, 40, 40, 6, "left"), bases._haar(9, 40, 6).float())
    assert (9, 40, 6) not in bases._cache
