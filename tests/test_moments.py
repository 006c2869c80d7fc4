"""Second-moment synchronisation (fedgalore.sync.moments) on factored MomentViews vs dense."""
import math

import pytest
import torch

from fedgalore.federated.payload import Factored, MomentView
from fedgalore.sync import ajive, project_moment, synchronize_moments

M, N, R = 48, 32, 4


def _dense(f):
    return f.left @ f.core @ f.right.T


def _basis(g, side, m=M, n=N, r=R):
    if side == "right":
        return torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))[0].T  # r × n
    return torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))[0]  # m × r


def _views(k=4, side="right", shared=True, seed=0):
    """Non-negative projected moments sharing a common part, on one or several bases."""
    g = torch.Generator().manual_seed(seed)
    common = torch.rand(M if side == "right" else N, R, generator=g, dtype=torch.float64)
    p0 = _basis(g, side)
    views = []
    for _ in range(k):
        own = torch.rand(common.shape, generator=g, dtype=torch.float64) * 0.3
        v = common + own
        mom = v if side == "right" else v.T
        views.append(MomentView(mom, side, (M, N), basis=p0 if shared else _basis(g, side)))
    return views


def _dense_views(views):
    return [(v.moment @ v.basis) if v.side == "right" else (v.basis @ v.moment) for v in views]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


W = [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("shared", [True, False])
def test_mean_and_mean_svd_match_dense(side, shared):
    views = _views(side=side, shared=shared)
    dense = _dense_views(views)
    p = torch.tensor(W, dtype=torch.float64) / sum(W)
    vbar = sum(pi * v for pi, v in zip(p, dense))
    res = synchronize_moments(views, W, "mean")
    assert _rel(_dense(res.state), vbar) < 1e-12
    assert res.state.shape == (M, N)
    mismatch = sum(float(pi * (v - vbar).norm()) for pi, v in zip(p, dense)) / float(vbar.norm())
    assert res.diagnostics["mismatch_before"] == pytest.approx(mismatch, rel=1e-9)
    assert res.diagnostics["mismatch_after"] == pytest.approx(mismatch, rel=1e-9)
    assert res.diagnostics["removed_fraction"] == pytest.approx(0.0, abs=1e-7)
    svd = synchronize_moments(views, W, "mean_svd", joint_rank=2)
    u, s, vt = torch.linalg.svd(vbar)
    assert _rel(_dense(svd.state), (u[:, :2] * s[:2]) @ vt[:2]) < 1e-10
    assert svd.diagnostics["joint_rank"] == 2
    assert svd.diagnostics["removed_fraction"] == pytest.approx(float(s[2:].norm() / s.norm()), rel=1e-8)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("shared", [True, False])
def test_ajive_mode_matches_dense_ajive(side, shared):
    views = _views(side=side, shared=shared, seed=1)
    dense = _dense_views(views)
    rows = [d if side == "right" else d.T for d in dense]  # AJIVE rows = the unprojected side
    res = synchronize_moments(views, W, "ajive", joint_rank=2)
    ref = ajive(rows, init_signal_ranks=R, joint_rank=2, svd="full")
    p = torch.tensor(W, dtype=torch.float64) / sum(W)
    vbar = sum(pi * (mu[None, :] + j) for pi, mu, j in zip(p, ref.means, ref.joint))
    vbar = vbar if side == "right" else vbar.T
    assert res.diagnostics["joint_rank"] == ref.joint_rank == 2
    assert _rel(_dense(res.state), vbar) < 1e-9
    after = sum(float(pi * (v - vbar).norm()) for pi, v in zip(p, dense)) / float(vbar.norm())
    assert res.diagnostics["mismatch_after"] == pytest.approx(after, rel=1e-8)
    mean = sum(pi * v for pi, v in zip(p, dense))
    assert res.diagnostics["removed_fraction"] == pytest.approx(float((mean - vbar).norm() / mean.norm()), rel=1e-8)


def test_ajive_default_rank_is_view_rank_and_auto_runs():
    views = _views(seed=2)
    res = synchronize_moments(views, W, "ajive")
    assert res.diagnostics["joint_rank"] <= R and res.state.core.shape[0] <= R + 1
    auto = synchronize_moments(views, W, "ajive", joint_rank="auto", n_wedin_samples=100, n_randdir_samples=100)
    assert 0 <= auto.diagnostics["joint_rank"] <= R
    assert auto.diagnostics["time_s"] > 0


def test_joint_rank_zero_is_mean_of_centring_means():
    views = _views(seed=3)
    dense = _dense_views(views)
    p = torch.tensor(W, dtype=torch.float64) / sum(W)
    res = synchronize_moments(views, W, "ajive", joint_rank=0)
    mu = sum(pi * d.mean(0) for pi, d in zip(p, dense))
    assert _rel(_dense(res.state), torch.ones(M, 1, dtype=torch.float64) * mu[None, :]) < 1e-12
    assert res.diagnostics["joint_rank"] == 0 and res.diagnostics["state_rank"] == 1


def test_single_view_ajive_full_rank_reproduces_view():
    views = _views(k=1, seed=4)
    res = synchronize_moments(views, [1.0], "ajive")
    assert _rel(_dense(res.state), _dense_views(views)[0]) < 1e-10
    assert res.diagnostics["mismatch_before"] == 0.0
    assert res.diagnostics["mismatch_after"] == pytest.approx(0.0, abs=1e-6)


def test_none_mode_and_errors():
    views = _views(seed=5)
    res = synchronize_moments(views, W, "none")
    assert res.state is None and res.diagnostics["mismatch_after"] == res.diagnostics["mismatch_before"] > 0
    with pytest.raises(ValueError, match="zero views"):
        synchronize_moments([], [], "mean")
    with pytest.raises(ValueError, match="unknown sync mode"):
        synchronize_moments(views, W, "median")
    bad = MomentView(views[0].moment.clone(), "right", (M, N), basis=views[0].basis)
    bad.moment[0, 0] = math.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        synchronize_moments([bad] + views[1:], W, "ajive")
    with pytest.raises(ValueError, match="weights"):
        synchronize_moments(views, [1.0, -1.0, 1.0, 1.0], "mean")
    with pytest.raises(ValueError, match="weights"):
        synchronize_moments(views, W[:2], "mean")
    with pytest.raises(ValueError, match="same side and shape"):
        synchronize_moments([views[0], _views(side="left")[0]], [1, 1], "mean")


def test_zero_views_and_too_large_rank():
    views = _views(seed=6)
    zero = MomentView(torch.zeros(M, R, dtype=torch.float64), "right", (M, N), basis=views[0].basis)
    res = synchronize_moments(views[:3] + [zero], W, "ajive", joint_rank=2)
    dense = _dense_views(views[:3])
    ref = ajive([*dense, torch.zeros(M, N, dtype=torch.float64)], init_signal_ranks=R, joint_rank=2, svd="full")
    p = torch.tensor(W, dtype=torch.float64) / sum(W)
    vbar = sum(pi * (mu[None, :] + j) for pi, mu, j in zip(p, ref.means, ref.joint))
    assert _rel(_dense(res.state), vbar) < 1e-9
    allzero = synchronize_moments([zero, zero], [1, 1], "ajive")
    assert float(_dense(allzero.state).abs().max()) == 0.0
    assert allzero.diagnostics["mismatch_before"] == 0.0
    with pytest.warns(RuntimeWarning, match="joint rank"):
        big = synchronize_moments(views, W, "ajive", joint_rank=50)
    assert big.diagnostics["joint_rank"] <= len(views) * R


def test_project_moment_matches_dense_and_clamps():
    views = _views(seed=7, shared=False)
    res = synchronize_moments(views, W, "ajive", joint_rank=2)
    full = _dense(res.state)
    g = torch.Generator().manual_seed(9)
    pr = _basis(g, "right")
    assert torch.allclose(project_moment(res.state, pr, "right"), (full @ pr.T).clamp_min(0), atol=1e-12)
    pl = _basis(g, "left")
    assert torch.allclose(project_moment(res.state, pl, "left", clamp=False), pl.T @ full, atol=1e-12)
    assert float(project_moment(res.state, -pr, "right").min()) >= 0.0


def test_float32_views():
    views = [MomentView(v.moment.float(), v.side, v.shape, basis=v.basis.float()) for v in _views(seed=8, shared=False)]
    res = synchronize_moments(views, W, "ajive", joint_rank=2)
    res64 = synchronize_moments(_views(seed=8, shared=False), W, "ajive", joint_rank=2)
    assert res.state.left.dtype == torch.float32
    assert _rel(_dense(res.state).double(), _dense(res64.state)) < 1e-5


def test_seeded_views_match_explicit_basis():
    """Views carrying only a seed (the random phase) sync like views carrying the basis."""
    projector = pytest.importorskip("fedgalore.optim.projector")
    if not hasattr(projector, "seeded_basis"):
        pytest.skip("seeded_basis not available")
    g = torch.Generator().manual_seed(10)
    p = projector.seeded_basis(123, M, N, R, "right")
    moms = [torch.rand(M, R, generator=g) for _ in range(3)]
    seeded = [MomentView(v, "right", (M, N), seed=123) for v in moms]
    explicit = [MomentView(v, "right", (M, N), basis=p) for v in moms]
    a = synchronize_moments(seeded, [1, 1, 1], "ajive", joint_rank=2)
    b = synchronize_moments(explicit, [1, 1, 1], "ajive", joint_rank=2)
    assert _rel(_dense(a.state), _dense(b.state)) < 1e-6
    assert a.diagnostics["mismatch_before"] == pytest.approx(b.diagnostics["mismatch_before"], rel=1e-6)
