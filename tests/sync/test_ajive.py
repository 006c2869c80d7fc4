"""AJIVE (fedgalore.sync.ajive): agreement with mvlearn, factored == dense, samplers, edge cases."""
import warnings

import numpy as np
import pytest
import torch

from fedgalore.protocol.payload import Factored
from fedgalore.sync import ajive, elbow_rank, thin_svd_factored
from fedgalore.sync.ajive import _randdir_samples, _sample_project_norms

pytestmark = [
    pytest.mark.filterwarnings("ignore::PendingDeprecationWarning"),  # numpy.matrix inside mvlearn
    pytest.mark.isa,  # numerically sensitive: make test runs it again with the CPU kernels forced down
]


def _dense(f):
    return f.left @ f.core @ f.right.T if isinstance(f, Factored) else f


def _rel(a, b):
    return float((_dense(a) - _dense(b)).norm() / max(float(_dense(b).norm()), 1e-30))


def _blocks(seed=0, n=120, dims=(40, 50, 60), noise=0.3):
    """Views sharing rows: a rank-2 joint score space, rank-3 individual parts, noise, offsets."""
    rng = np.random.default_rng(seed)
    joint = rng.standard_normal((n, 2))
    xs = []
    for d in dims:
        ind = rng.standard_normal((n, 3)) @ rng.standard_normal((3, d)) * 2
        xs.append(joint @ rng.standard_normal((2, d)) * 3 + ind + noise * rng.standard_normal((n, d)) + 1.0)
    return xs


def _factored_blocks(seed=0, m=100, dims=(30, 45), rank=8, dtype=torch.float64):
    """Exactly low-rank views given as factors (non-orthonormal L, R, a dense core)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(m, 3, generator=g, dtype=dtype)
    out = []
    for d in dims:
        left = torch.cat([shared, torch.randn(m, rank - 3, generator=g, dtype=dtype)], 1)
        core = torch.randn(rank, rank, generator=g, dtype=dtype)
        right = torch.randn(d, rank, generator=g, dtype=dtype)
        out.append(Factored(left, core, right + 0.5))
    return out


# ----------------------------------------------------------------------------- vs mvlearn
def test_matches_mvlearn_fixed_ranks():
    mv_mod = pytest.importorskip("mvlearn.decomposition")
    xs = _blocks()
    mv = mv_mod.AJIVE(init_signal_ranks=[5, 5, 5], joint_rank=2).fit(xs)
    res = ajive([torch.tensor(x) for x in xs], init_signal_ranks=[5, 5, 5], joint_rank=2)
    np.testing.assert_allclose(res.sv_thresholds, mv.sv_thresholds_, rtol=1e-10)
    np.testing.assert_allclose(res.all_joint_svals.numpy(), mv.all_joint_svals_, rtol=1e-9, atol=1e-12)
    assert res.joint_rank == mv.joint_rank_ == 2
    assert res.individual_ranks == [int(r) for r in mv.individual_ranks_] == [3, 3, 3]
    for k, x in enumerate(xs):
        np.testing.assert_allclose(res.means[k].numpy(), mv.means_[k], rtol=1e-12)
        np.testing.assert_allclose(res.joint[k].numpy(), mv.transform(xs)[k], atol=1e-9)
        np.testing.assert_allclose(res.individual[k].numpy(), mv.individual_mats_[k], atol=1e-8)
    # joint scores span the same space
    u, um = res.joint_scores.numpy(), mv.joint_scores_
    np.testing.assert_allclose(u @ u.T, um @ um.T, atol=1e-10)


def test_matches_mvlearn_elbow_ranks():
    mv_mod = pytest.importorskip("mvlearn.decomposition")
    xs = _blocks(seed=1)
    mv = mv_mod.AJIVE(joint_rank=2).fit(xs)
    res = ajive([torch.tensor(x) for x in xs], joint_rank=2)
    assert res.init_signal_ranks == [int(r) for r in mv.init_signal_ranks_]
    np.testing.assert_allclose(res.sv_thresholds, mv.sv_thresholds_, rtol=1e-10)


def test_matches_mvlearn_estimated_joint_rank():
    """Random bounds: same joint rank; cutoffs agree to Monte-Carlo accuracy (different RNGs)."""
    mv_mod = pytest.importorskip("mvlearn.decomposition")
    xs = _blocks(seed=2, n=80, dims=(20, 25, 30))
    state = np.random.get_state()
    mv = mv_mod.AJIVE(init_signal_ranks=[5, 5, 5], n_wedin_samples=300, n_randdir_samples=300, random_state=0).fit(xs)
    np.random.set_state(state)  # mvlearn reseeds numpy's global RNG; undo it for other tests
    res = ajive([torch.tensor(x) for x in xs], init_signal_ranks=[5, 5, 5], n_wedin_samples=300, n_randdir_samples=300, seed=0)
    assert res.joint_rank == mv.joint_rank_ == 2
    assert res.joint_rank_wedin_est == mv.joint_rank_wedin_est_
    assert res.wedin_cutoff == pytest.approx(mv.wedin_cutoff_, rel=0.03)
    assert res.rand_cutoff == pytest.approx(mv.rand_cutoff_, rel=0.05)
    assert res.svalsq_cutoff == max(res.wedin_cutoff, res.rand_cutoff)


def _identifiability_case():
    """View A holds only direction a; views B, C hold a, c, e. Forcing joint rank 3 makes the two
    {c, e} candidates fail in view A: both must go (mvlearn removes at most one per view)."""
    g = torch.Generator().manual_seed(5)
    m = 60
    q = torch.linalg.qr(torch.randn(m, 3, generator=g, dtype=torch.float64))[0]
    a, c, e = q[:, :1], q[:, 1:2], q[:, 2:3]
    def view(cols, svals, d):
        right = torch.linalg.qr(torch.randn(d, len(cols), generator=g, dtype=torch.float64))[0]
        x = torch.cat(cols, 1) @ torch.diag(torch.tensor(svals, dtype=torch.float64)) @ right.T
        return x + 0.01 * torch.randn(m, d, generator=g, dtype=torch.float64)
    return [view([a], [10.0], 20), view([a, c, e], [10.0, 6.0, 5.0], 25), view([a, c, e], [9.0, 6.5, 5.5], 30)]


def test_identifiability_drops_every_failing_component():
    xs = _identifiability_case()
    res = ajive(xs, init_signal_ranks=[1, 3, 3], joint_rank=3, center=False)
    assert res.dropped_components == [1, 2] and res.joint_rank == 1
    # the rule, recomputed directly: drop j iff some view has ‖X_kᵀ u_j‖ < τ_k
    full = ajive(xs, init_signal_ranks=[1, 3, 3], joint_rank=3, center=False, reconsider_joint_components=False)
    assert full.joint_rank == 3
    norms = torch.stack([(x.T @ full.joint_scores).norm(dim=0) for x in xs])
    fail = (norms < torch.tensor(full.sv_thresholds)[:, None]).any(0)
    assert fail.tolist() == [False, True, True]


def test_identifiability_mvlearn_bug_documented():
    mv_mod = pytest.importorskip("mvlearn.decomposition")
    xs = _identifiability_case()
    mv = mv_mod.AJIVE(init_signal_ranks=[1, 3, 3], joint_rank=3).fit([x.numpy() for x in xs])
    ours = ajive(xs, init_signal_ranks=[1, 3, 3], joint_rank=3)
    assert mv.joint_rank_ == 2 and ours.joint_rank == 1  # mvlearn: at most one removal per view


# ----------------------------------------------------------------------------- factored == dense
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_factored_equals_dense_fixed_ranks(dtype, tol):
    fs = _factored_blocks(dtype=dtype)
    dense = [_dense(f) for f in fs]
    a = ajive(dense, init_signal_ranks=[6, 6], joint_rank=3, svd="full")
    b = ajive(fs, init_signal_ranks=[6, 6], joint_rank=3)
    assert isinstance(b.joint[0], Factored) and not isinstance(a.joint[0], Factored)
    assert a.joint_rank == b.joint_rank == 3
    np.testing.assert_allclose(a.sv_thresholds, b.sv_thresholds, rtol=tol)
    np.testing.assert_allclose(a.all_joint_svals.numpy(), b.all_joint_svals.numpy(), rtol=tol, atol=tol)
    for k in range(2):
        assert _rel(b.joint[k], a.joint[k]) < tol
        assert _rel(b.individual[k], a.individual[k]) < tol
        assert a.individual_ranks[k] == b.individual_ranks[k]
        assert _rel(b.means[k], a.means[k]) < tol


def test_factored_equals_dense_estimated_ranks_same_seed():
    fs = _factored_blocks(seed=3)
    dense = [_dense(f) for f in fs]
    a = ajive(dense, n_wedin_samples=200, n_randdir_samples=200, seed=7)
    b = ajive(fs, n_wedin_samples=200, n_randdir_samples=200, seed=7)
    assert a.init_signal_ranks == b.init_signal_ranks
    assert a.joint_rank == b.joint_rank
    assert a.wedin_cutoff == pytest.approx(b.wedin_cutoff, rel=1e-6)
    assert a.rand_cutoff == pytest.approx(b.rand_cutoff, rel=1e-9)
    for k in range(2):
        assert _rel(b.joint[k], a.joint[k]) < 1e-8


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_iterative_joint_svd_matches_exact(dtype, tol):
    """Many views (Σ r_k ≥ 256): the subspace-iteration SVD of M gives the exact joint part."""
    g = torch.Generator().manual_seed(8)
    m, d, r, k = 1200, 60, 10, 60
    shared = torch.randn(m, 3, generator=g, dtype=dtype)
    fs = [Factored(torch.cat([shared, torch.randn(m, r - 3, generator=g, dtype=dtype)], 1), torch.eye(r, dtype=dtype),
                   torch.randn(d, r, generator=g, dtype=dtype)) for _ in range(k)]
    a = ajive(fs, init_signal_ranks=r, joint_rank=3, compute_individual=False, joint_svd="exact")
    b = ajive(fs, init_signal_ranks=r, joint_rank=3, compute_individual=False)  # auto -> iterative
    assert b.all_joint_svals.numel() < a.all_joint_svals.numel()  # only the leading block is computed
    np.testing.assert_allclose(b.all_joint_svals[:3].numpy(), a.all_joint_svals[:3].numpy(), rtol=tol)
    assert a.joint_rank == b.joint_rank == 3
    for i in (0, k - 1):
        assert _rel(b.joint[i], a.joint[i]) < tol


def test_decomposition_adds_up():
    xs = [torch.tensor(x) for x in _blocks(seed=4)]
    res = ajive(xs, init_signal_ranks=5, joint_rank=2)
    for k, x in enumerate(xs):
        recon = res.means[k][None, :] + res.joint[k] + res.individual[k] + res.noise[k]
        assert float((recon - x).abs().max()) < 1e-10
    fs = _factored_blocks()
    res = ajive(fs, init_signal_ranks=4, joint_rank=2)
    for k, f in enumerate(fs):
        recon = res.means[k][None, :] + _dense(res.joint[k]) + _dense(res.individual[k]) + _dense(res.noise[k])
        assert _rel(recon, _dense(f)) < 1e-10


def test_thin_svd_factored_matches_dense():
    f = _factored_blocks()[0]
    u, s, v = thin_svd_factored(f.left, f.core, f.right)
    ref = torch.linalg.svdvals(_dense(f))
    assert s.numel() == 8
    np.testing.assert_allclose(s.numpy(), ref[:8].numpy(), rtol=1e-10)
    assert _rel((u * s) @ v.T, _dense(f)) < 1e-12


def test_truncated_path_matches_full_on_gapped_data():
    xs = [torch.tensor(x) for x in _blocks(seed=5, noise=0.05)]
    a = ajive(xs, init_signal_ranks=5, joint_rank=2, individual_ranks=[3, 3, 3], svd="full")
    b = ajive(xs, init_signal_ranks=5, joint_rank=2, individual_ranks=[3, 3, 3], svd="truncated", n_iter=8)
    for k in range(3):
        assert _rel(b.joint[k], a.joint[k]) < 1e-6
        assert _rel(b.individual[k], a.individual[k]) < 1e-6
    np.testing.assert_allclose(b.sv_thresholds[0], a.sv_thresholds[0], rtol=0.05)  # (r+1)-th sv is in the noise bulk


# ----------------------------------------------------------------------------- samplers
def test_sample_project_distribution_matches_brute_force():
    """Our factored Wedin draws have the law of mvlearn's sample-project draws."""
    g = torch.Generator().manual_seed(0)
    m, d, r = 50, 30, 3
    x = torch.randn(m, d, generator=g, dtype=torch.float64) @ torch.diag(torch.linspace(3, 0.1, d, dtype=torch.float64))
    u, s, vt = torch.linalg.svd(x, full_matrices=False)
    n = 3000
    ours = _sample_project_norms(s[r:], r, m - s.numel(), n, g)
    psi = torch.randn(n, m, r, generator=g, dtype=torch.float64)
    psi = psi - u[:, :r] @ (u[:, :r].T @ psi)
    psi = torch.linalg.qr(psi)[0]
    brute = torch.linalg.matrix_norm(x.T @ psi, ord=2)
    for q in (0.05, 0.5, 0.95):
        assert float(torch.quantile(ours, q)) == pytest.approx(float(torch.quantile(brute, q)), rel=0.03)


def test_randdir_distribution_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    m, ranks, n = 40, [3, 4, 2], 3000
    ours = _randdir_samples(m, ranks, n, g)
    blocks = [torch.linalg.qr(torch.randn(n, m, r, generator=g, dtype=torch.float64))[0] for r in ranks]
    brute = torch.linalg.matrix_norm(torch.cat(blocks, 2), ord=2) ** 2
    for q in (0.05, 0.5, 0.95):
        assert float(torch.quantile(ours, q)) == pytest.approx(float(torch.quantile(brute, q)), rel=0.02)


def test_elbow_rank_on_clear_spectrum():
    sv = torch.tensor([50.0, 48, 47, 10, 9.5, 9, 1, 0.9, 0.8, 0.7])
    assert elbow_rank(sv, n_elbows=1) == 3
    assert elbow_rank(sv, n_elbows=2) == 6


# ----------------------------------------------------------------------------- edge cases
def test_randomness_is_local_and_seeded():
    xs = [torch.tensor(x) for x in _blocks(seed=6, n=60, dims=(15, 20))]
    torch_state, np_state = torch.random.get_rng_state(), np.random.get_state()[1].copy()
    a = ajive(xs, init_signal_ranks=4, n_wedin_samples=100, n_randdir_samples=100, seed=11)
    b = ajive(xs, init_signal_ranks=4, n_wedin_samples=100, n_randdir_samples=100, generator=torch.Generator().manual_seed(11))
    c = ajive(xs, init_signal_ranks=4, n_wedin_samples=100, n_randdir_samples=100, seed=12)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], np_state)
    assert torch.equal(a.wedin_sv_samples, b.wedin_sv_samples)
    assert not torch.equal(a.wedin_sv_samples, c.wedin_sv_samples)


def test_errors():
    with pytest.raises(ValueError, match="at least one view"):
        ajive([])
    x = torch.randn(20, 10, dtype=torch.float64)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="view 1 contains NaN"):
        ajive([x, bad], init_signal_ranks=2, joint_rank=1)
    with pytest.raises(ValueError, match="same number of rows"):
        ajive([x, torch.randn(21, 10, dtype=torch.float64)], init_signal_ranks=2, joint_rank=1)
    with pytest.raises(ValueError, match="truncated"):
        ajive([x], svd="truncated")


def test_zero_view_and_rank_caps():
    fs = _factored_blocks()
    zero = Factored(torch.zeros(100, 2, dtype=torch.float64), torch.eye(2, dtype=torch.float64), torch.zeros(30, 2, dtype=torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a zero view must not warn
        res = ajive(fs + [zero], init_signal_ranks=[6, 6, 1], joint_rank=3)
    assert res.init_signal_ranks[2] == 0 and res.sv_thresholds[2] == 0.0
    assert float(_dense(res.joint[2]).abs().max()) == 0.0
    ref = ajive(fs, init_signal_ranks=[6, 6], joint_rank=3)
    assert _rel(res.joint[0], ref.joint[0]) < 1e-10
    # ranks beyond what a view allows are lowered with a warning
    with pytest.warns(RuntimeWarning, match="numerical rank"):
        r2 = ajive(fs, init_signal_ranks=[20, 6], joint_rank=3)
    assert r2.init_signal_ranks[0] == 8  # rank-8 factors; centring keeps rank 8 here
    with pytest.warns(RuntimeWarning, match="min\\(shape\\)"):
        r3 = ajive([torch.randn(10, 4, dtype=torch.float64)] * 2, init_signal_ranks=9, joint_rank=1)
    assert r3.init_signal_ranks == [3, 3]
    with pytest.warns(RuntimeWarning, match="joint rank"):
        r4 = ajive(fs, init_signal_ranks=[2, 2], joint_rank=10)
    assert r4.joint_rank <= 4


def test_joint_rank_zero_and_single_view_and_no_centring():
    xs = [torch.tensor(x) for x in _blocks(seed=7)]
    res = ajive(xs, init_signal_ranks=5, joint_rank=0)
    assert res.joint_rank == 0 and all(float(j.abs().max()) == 0 for j in res.joint)
    one = ajive(xs[:1], init_signal_ranks=5, joint_rank=2)
    u, s, vt = torch.linalg.svd(xs[0] - xs[0].mean(0), full_matrices=False)
    assert _rel(one.joint[0], (u[:, :2] * s[:2]) @ vt[:2]) < 1e-10
    nc = ajive(xs, init_signal_ranks=5, joint_rank=2, center=False)
    assert nc.means is None
    for k, x in enumerate(xs):
        assert float((nc.joint[k] + nc.individual[k] + nc.noise[k] - x).abs().max()) < 1e-10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_runs_on_gpu():
    fs = _factored_blocks(dtype=torch.float32)
    gpu = [Factored(f.left.cuda(), f.core.cuda(), f.right.cuda()) for f in fs]
    a = ajive(gpu, init_signal_ranks=[6, 6], n_wedin_samples=100, n_randdir_samples=100)
    b = ajive(fs, init_signal_ranks=[6, 6], n_wedin_samples=100, n_randdir_samples=100)
    assert a.joint_rank == b.joint_rank
    assert _rel(_dense(a.joint[0]).cpu(), b.joint[0]) < 1e-4
