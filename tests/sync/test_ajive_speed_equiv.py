"""The AJIVE fast paths (issue 18) give the exact algorithm's numbers to float tolerance.

* packed per-view buffers (all-factored inputs) vs the unpacked path (a list that mixes a dense
  view in), on the server's shape: many float32 rank-r views on one shared basis;
* the iterative joint SVD with its float32 tolerance vs the exact Gram eigendecomposition in
  float64 on the same views;
* ``Mᵀu`` reused for the identifiability check, including views whose numerical rank exceeds
  their signal rank (the reused block then covers only part of ``U_k``);
* the subspace iteration stops at its rounding floor instead of running to ``max_iter``.
"""
import importlib

import numpy as np
import pytest
import torch

from fedgalore.protocol.payload import Factored
from fedgalore.sync import ajive

pytestmark = pytest.mark.isa  # numerically sensitive: make test runs it again with the CPU kernels forced down

A = importlib.import_module("fedgalore.sync.ajive")


def _dense(f):
    return f.left.double() @ f.core.double() @ f.right.double().T if isinstance(f, Factored) else f.double()


def _rel(a, b):
    a, b = _dense(a), _dense(b)
    return float((a - b).norm() / b.norm())


def _server_views(k=40, m=1500, d=300, r=16, dtype=torch.float32, seed=0):
    """Client moment views on one seeded basis: V_i = (common + 0.3·own_i) Pᵀ (FedGaLore's S)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.linalg.qr(torch.randn(d, r, generator=g, dtype=torch.float64))[0].to(dtype)
    common = torch.rand(m, r, generator=g, dtype=torch.float64)
    eye = torch.eye(r, dtype=dtype)
    return [Factored((common + 0.3 * torch.rand(m, r, generator=g, dtype=torch.float64)).to(dtype), eye, p) for _ in range(k)]


def test_fast_float32_path_matches_float64_exact_reference():
    views = _server_views()
    fast = ajive(views, init_signal_ranks=16, joint_rank=16, compute_individual=False, seed=1)  # packed, iterative
    ref64 = [Factored(v.left.double(), v.core.double(), v.right.double()) for v in views]
    ref = ajive(ref64, init_signal_ranks=16, joint_rank=16, compute_individual=False, joint_svd="exact", seed=1)
    assert fast.joint_rank == ref.joint_rank == 16 and fast.dropped_components == ref.dropped_components == []
    np.testing.assert_allclose(fast.all_joint_svals[:16].numpy(), ref.all_joint_svals[:16].numpy(), rtol=1e-6)
    np.testing.assert_allclose(fast.sv_thresholds, ref.sv_thresholds, rtol=1e-5)
    for i in (0, 17, 39):
        assert _rel(fast.joint[i], ref.joint[i]) < 2e-5
        assert _rel(fast.means[i][None, :], ref.means[i][None, :]) < 1e-6
    # the server's synchronised state Σ p_i J_i (equal weights): the number that is broadcast
    fast_sum = sum(_dense(j) for j in fast.joint)
    ref_sum = sum(_dense(j) for j in ref.joint)
    assert float((fast_sum - ref_sum).norm() / ref_sum.norm()) < 1e-5


def test_packed_and_unpacked_paths_agree():
    views = _server_views(k=30, m=800, d=200, r=12, dtype=torch.float64, seed=2)
    dense_last = views[:-1] + [_dense(views[-1])]  # one dense view: no packing, views concatenated
    a = ajive(views, init_signal_ranks=12, joint_rank=6, individual_ranks=[3] * 30, svd="full", joint_svd="exact")
    b = ajive(dense_last, init_signal_ranks=12, joint_rank=6, individual_ranks=[3] * 30, svd="full", joint_svd="exact")
    assert a.joint_rank == b.joint_rank == 6
    np.testing.assert_allclose(a.all_joint_svals.numpy(), b.all_joint_svals.numpy(), rtol=1e-9)
    for i in (0, 12, 28, 29):
        assert _rel(a.joint[i], b.joint[i]) < 1e-9
        assert _rel(a.individual[i], b.individual[i]) < 1e-8


def _identifiability_factored():
    """As tests/sync/test_ajive.py's case, factored and with noise columns: view A's signal rank (1) is
    below its numerical rank, so the reused Mᵀu block covers only part of U_A."""
    g = torch.Generator().manual_seed(5)
    m = 60
    q = torch.linalg.qr(torch.randn(m, 3, generator=g, dtype=torch.float64))[0]
    a, c, e = q[:, :1], q[:, 1:2], q[:, 2:3]

    def view(cols, svals, d):
        left = torch.cat(cols + [0.01 * torch.randn(m, 2, generator=g, dtype=torch.float64)], 1)
        core = torch.diag(torch.tensor(list(svals) + [1.0, 1.0], dtype=torch.float64))
        right = torch.linalg.qr(torch.randn(d, len(cols) + 2, generator=g, dtype=torch.float64))[0]
        return Factored(left, core, right)

    return [view([a], [10.0], 20), view([a, c, e], [10.0, 6.0, 5.0], 25), view([a, c, e], [9.0, 6.5, 5.5], 30)]


@pytest.mark.parametrize("joint_svd", ["exact", "iterative"])
def test_identifiability_with_reused_products_matches_direct_rule(joint_svd):
    fs = _identifiability_factored()
    res = ajive(fs, init_signal_ranks=[1, 3, 3], joint_rank=3, center=False, joint_svd=joint_svd)
    full = ajive(fs, init_signal_ranks=[1, 3, 3], joint_rank=3, center=False, joint_svd=joint_svd,
                 reconsider_joint_components=False)
    assert full.joint_rank == 3
    norms = torch.stack([(_dense(f).T @ full.joint_scores).norm(dim=0) for f in fs])  # ‖X_kᵀ u_j‖ directly
    fail = (norms < torch.tensor(full.sv_thresholds, dtype=torch.float64)[:, None]).any(0)
    assert fail.tolist() == [False, True, True]
    assert res.dropped_components == [1, 2] and res.joint_rank == 1
    # coefficients reused from Mᵀu equal U_Jᵀ X_k computed from the dense matrices
    for f, coef, right in zip(fs, res.joint_coefs, res.joint_rights):
        assert float((coef @ right.T - res.joint_scores.T @ _dense(f)).abs().max()) < 1e-10


def test_subspace_iteration_stops_at_its_rounding_floor():
    views = _server_views(k=40, m=1500, d=300, r=16)
    st = [A._ViewState(v, True) for v in views]
    for s in st:
        s.compact(None, {})
    mstack = torch.cat([s.U for s in st], 1)
    gen = torch.Generator().manual_seed(0)
    u, sv, mtu, steps = A._top_left_singular(mstack, 16, gen, tol=1e-12)  # unreachable in float32
    assert steps < 15
    u_ref, _, _, _ = A._top_left_singular(mstack.double(), 16, torch.Generator().manual_seed(0))
    u, u_ref = u.double(), u_ref
    assert float((u_ref @ (u_ref.T @ u) - u).norm()) < 1e-4  # the same subspace
    assert float((mtu.double() - mstack.double().T @ u).abs().max()) < 1e-5  # Mᵀu handed back is Mᵀu


def test_all_finite_matches_isfinite():
    x = torch.rand(50, 7)
    assert A.all_finite(x) and A.all_finite(torch.empty(0, 3))
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[3, 4] = bad
        assert not A.all_finite(y) and not bool(torch.isfinite(y).all())
    with pytest.raises(ValueError, match="view 1 contains NaN"):
        ajive([x.double(), torch.full((50, 7), float("nan"), dtype=torch.float64)], init_signal_ranks=2, joint_rank=1)
