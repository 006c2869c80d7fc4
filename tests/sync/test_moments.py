"""Second-moment synchronisation (fedgalore.sync.moments): shared-basis views vs dense
computations, the consensus basis, prior weights, sign invariance and the joint-rank estimate."""
import math

import pytest
import torch

from fedgalore.protocol.bases import seeded_basis
from fedgalore.protocol.payload import MomentView
from fedgalore.sync import ajive, consensus_basis, synchronize_moments

pytestmark = pytest.mark.isa  # numerically sensitive: make test runs it again with the CPU kernels forced down

M, N, R = 48, 32, 4


def _basis(g, side, m=M, n=N, r=R):
    if side == "right":
        return torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))[0].T  # r × n
    return torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))[0]  # m × r


def _views(k=4, side="right", shared=True, seed=0, weights=False):
    """Non-negative projected moments sharing a common part, on one or several bases."""
    g = torch.Generator().manual_seed(seed)
    common = torch.rand(M if side == "right" else N, R, generator=g, dtype=torch.float64)
    p0 = _basis(g, side)
    views = []
    for _ in range(k):
        own = torch.rand(common.shape, generator=g, dtype=torch.float64) * 0.3
        v = common + own
        mom = v if side == "right" else v.T
        w = torch.rand(R, generator=g, dtype=torch.float64) * 0.1 if weights else None
        views.append(MomentView(mom, side, (M, N), basis=p0 if shared else _basis(g, side), weight=w))
    return views


def _full(v):
    """The full-space matrix of a view in float64 (V = v P right / P v left)."""
    p = v.basis.double() if v.basis is not None else seeded_basis(v.seed, *v.shape, v.rank, v.side).double()
    return v.moment.double() @ p if v.side == "right" else p @ v.moment.double()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


W = [1.0, 2.0, 3.0, 4.0]
P = torch.tensor(W, dtype=torch.float64) / sum(W)


@pytest.mark.parametrize("side", ["right", "left"])
def test_mean_and_mean_svd_on_a_shared_basis_match_dense(side):
    views = _views(side=side)
    dense = [_full(v) for v in views]
    vbar = sum(pi * v for pi, v in zip(P, dense))
    res = synchronize_moments(views, W, "mean")
    assert isinstance(res.state, MomentView) and res.state.basis is views[0].basis  # on the shared basis
    assert _rel(_full(res.state), vbar) < 1e-12
    mismatch = sum(float(pi * (v - vbar).norm()) for pi, v in zip(P, dense)) / float(vbar.norm())
    assert res.diagnostics["mismatch_before"] == pytest.approx(mismatch, rel=1e-9)
    assert res.diagnostics["removed_fraction"] == pytest.approx(0.0, abs=1e-7)
    assert res.diagnostics["basis_overlap"] == 1.0
    svd = synchronize_moments(views, W, "mean_svd", joint_rank=2)
    u, s, vt = torch.linalg.svd(vbar)
    assert _rel(_full(svd.state), (u[:, :2] * s[:2]) @ vt[:2]) < 1e-10
    assert svd.diagnostics["joint_rank"] == 2


@pytest.mark.parametrize("side", ["right", "left"])
def test_ajive_on_a_shared_basis_matches_dense_ajive(side):
    views = _views(side=side, seed=1)
    dense = [_full(v) for v in views]
    rows = [d if side == "right" else d.T for d in dense]  # AJIVE rows = the unprojected side
    res = synchronize_moments(views, W, "ajive", joint_rank=2)
    ref = ajive(rows, init_signal_ranks=R, joint_rank=2, svd="full")
    vbar = sum(pi * (mu[None, :] + j) for pi, mu, j in zip(P, ref.means, ref.joint))
    vbar = vbar if side == "right" else vbar.T
    assert res.diagnostics["joint_rank"] == ref.joint_rank == 2
    # v̄ lies in the span of the shared basis: its coordinates reproduce it exactly
    assert _rel(_full(res.state), vbar) < 1e-9
    after = sum(float(pi * (v - vbar).norm()) for pi, v in zip(P, dense)) / float(vbar.norm())
    assert res.diagnostics["mismatch_after"] == pytest.approx(after, rel=1e-8)


@pytest.mark.parametrize("side", ["right", "left"])
def test_consensus_basis_and_views_moved_onto_it(side):
    """Views on different bases: B = top-r eigenvectors of Σ p_i P_iᵀP_i; every view moves onto
    B by the squared rule with its weights; then the sync is the shared-basis sync, pooled by
    evidence: v̄_j = Σ_i p_i c_ij v_ij / Σ_i p_i c_ij, c̄ = Σ_i p_i c_i."""
    views = _views(side=side, shared=False, seed=2, weights=True)
    res = synchronize_moments(views, W, "mean")
    st = res.state
    b = st.basis
    proj = sum(pi * (v.basis.T @ v.basis if side == "right" else v.basis @ v.basis.T) for pi, v in zip(P, views))
    evals, evecs = torch.linalg.eigh(proj)
    top = evecs[:, -R:]
    # same subspace as the top-R eigenvectors
    bb = b.T if side == "right" else b
    assert torch.allclose(bb @ bb.T, top @ top.T, atol=1e-10)
    moved, wts = [], []
    for v in views:
        c = v.basis @ b.T if side == "right" else b.T @ v.basis
        cc = c * c
        if side == "right":
            raw, w = (v.moment * v.weight[None, :]) @ cc, v.weight[None, :] @ cc
        else:
            raw, w = cc @ (v.moment * v.weight[:, None]), cc @ v.weight[:, None]
        moved.append(raw / w)
        wts.append(w.flatten())
    cbar = sum(pi * w for pi, w in zip(P, wts))
    ev = (lambda w: w[None, :]) if side == "right" else (lambda w: w[:, None])
    mean = sum(pi * ev(w) * m for pi, w, m in zip(P, wts, moved)) / ev(cbar)
    assert torch.allclose(st.moment, mean, atol=1e-12)
    assert torch.allclose(st.weight, cbar, atol=1e-14)
    overlap = sum(float(pi) * float(((v.basis @ b.T if side == "right" else b.T @ v.basis) ** 2).sum()) / R for pi, v in zip(P, views))
    assert res.diagnostics["basis_overlap"] == pytest.approx(overlap, rel=1e-10)
    assert 0 < overlap < 1


def test_consensus_sync_is_invariant_to_the_sign_of_client_basis_vectors():
    views = _views(shared=False, seed=3, weights=True)
    flipped = []
    for i, v in enumerate(views):
        p = v.basis.clone()
        p[i % R] = -p[i % R]
        flipped.append(MomentView(v.moment, v.side, v.shape, p, None, v.weight))
    a = synchronize_moments(views, W, "ajive", joint_rank=2)
    b = synchronize_moments(flipped, W, "ajive", joint_rank=2)
    assert _rel(_full(b.state), _full(a.state)) < 1e-10


def test_consensus_of_identical_bases_is_that_basis():
    g = torch.Generator().manual_seed(4)
    p0 = _basis(g, "right")
    for ws in ([1, 2, 3], [1]):
        b = consensus_basis([p0] * len(ws), ws, R, "right")
        assert torch.allclose(b @ b.T, torch.eye(R, dtype=torch.float64), atol=1e-12)
        assert torch.allclose(b.T @ b, p0.T @ p0, atol=1e-12)  # the same subspace


def test_joint_rank_auto_finds_a_planted_joint_rank():
    """Views of exactly rank r = 8 with a planted joint rank 2: the Wedin / random-direction
    estimate needs a residual spectrum, which the elbow-chosen signal ranks provide."""
    g = torch.Generator().manual_seed(5)
    m, n, r, k = 200, 64, 8, 5
    joint = torch.linalg.qr(torch.randn(m, 2, generator=g, dtype=torch.float64))[0]
    views = []
    for _ in range(k):
        indiv = torch.linalg.qr(torch.randn(m, 2, generator=g, dtype=torch.float64))[0]
        scores = torch.cat([joint * torch.tensor([30.0, 20.0], dtype=torch.float64),
                            indiv * torch.tensor([12.0, 9.0], dtype=torch.float64),
                            0.3 * torch.randn(m, r - 4, generator=g, dtype=torch.float64)], 1)
        coef = scores @ torch.linalg.qr(torch.randn(r, r, generator=g, dtype=torch.float64))[0]
        views.append(MomentView(coef, "right", (m, n), seed=77))
    res = synchronize_moments(views, [1.0] * k, "ajive", joint_rank="auto", center=False)
    assert res.diagnostics["joint_rank"] == 2
    fixed = synchronize_moments(views, [1.0] * k, "ajive", center=False)  # k = r: everything above noise
    assert fixed.diagnostics["joint_rank"] > 2


def test_joint_rank_zero_is_mean_of_centring_means():
    views = _views(seed=6)
    dense = [_full(v) for v in views]
    res = synchronize_moments(views, W, "ajive", joint_rank=0)
    mu = sum(pi * d.mean(0) for pi, d in zip(P, dense))
    assert _rel(_full(res.state), torch.ones(M, 1, dtype=torch.float64) * mu[None, :]) < 1e-12
    assert res.diagnostics["joint_rank"] == 0 and res.diagnostics["state_rank"] == 1


def test_single_view_ajive_full_rank_reproduces_view():
    views = _views(k=1, seed=7)
    res = synchronize_moments(views, [1.0], "ajive")
    assert _rel(_full(res.state), _full(views[0])) < 1e-10
    assert res.diagnostics["mismatch_before"] == 0.0


def test_none_mode_and_errors():
    views = _views(seed=8)
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
    with pytest.raises(ValueError, match="does not fit"):
        synchronize_moments([MomentView(torch.zeros(M + 1, R), "right", (M, N), seed=1)], [1], "mean")


def test_zero_view_and_too_large_rank():
    views = _views(seed=9)
    zero = MomentView(torch.zeros(M, R, dtype=torch.float64), "right", (M, N), basis=views[0].basis)
    res = synchronize_moments(views[:3] + [zero], W, "ajive", joint_rank=2)
    dense = [_full(v) for v in views[:3]]
    ref = ajive([*dense, torch.zeros(M, N, dtype=torch.float64)], init_signal_ranks=R, joint_rank=2, svd="full")
    vbar = sum(pi * (mu[None, :] + j) for pi, mu, j in zip(P, ref.means, ref.joint))
    assert _rel(_full(res.state), vbar) < 1e-9
    allzero = synchronize_moments([zero, zero], [1, 1], "ajive")
    assert float(allzero.state.moment.abs().max()) == 0.0
    with pytest.warns(RuntimeWarning, match="joint rank"):
        big = synchronize_moments(views, W, "ajive", joint_rank=50)
    assert big.diagnostics["joint_rank"] <= len(views) * R


def test_float32_views():
    views = [MomentView(v.moment.float(), v.side, v.shape, basis=v.basis.float()) for v in _views(seed=10, shared=False)]
    res = synchronize_moments(views, W, "ajive", joint_rank=2)
    res64 = synchronize_moments(_views(seed=10, shared=False), W, "ajive", joint_rank=2)
    assert res.state.moment.dtype == torch.float32
    assert _rel(_full(res.state), _full(res64.state)) < 1e-5


def test_seeded_views_sync_on_their_seed_and_match_explicit_basis():
    """Views carrying only the round's seed (Algorithm 1 line 13) sync on that seeded basis and the
    state carries the seed, not the basis."""
    g = torch.Generator().manual_seed(11)
    p = seeded_basis(123, M, N, R, "right")
    moms = [torch.rand(M, R, generator=g) for _ in range(3)]
    seeded = [MomentView(v, "right", (M, N), seed=123) for v in moms]
    explicit = [MomentView(v, "right", (M, N), basis=p) for v in moms]
    a = synchronize_moments(seeded, [1, 1, 1], "ajive", joint_rank=2)
    b = synchronize_moments(explicit, [1, 1, 1], "ajive", joint_rank=2)
    assert a.state.seed == 123 and a.state.basis is None
    assert _rel(a.state.moment.double(), b.state.moment.double()) < 1e-6
    assert a.diagnostics["mismatch_before"] == pytest.approx(b.diagnostics["mismatch_before"], rel=1e-6)


@pytest.mark.parametrize("mode", ["none", "mean", "ajive"])
@pytest.mark.parametrize("orthonormal", [True, False])
def test_closed_form_diagnostics_on_a_shared_basis_match_dense(mode, orthonormal):
    """The shared-basis closed form equals the definitions on dense matrices (also for a shared
    right factor that is not orthonormal)."""
    from fedgalore.sync.moments import synchronize

    views = _views(seed=12)
    b = views[0].basis.T if orthonormal else views[0].basis.T * torch.tensor([1.0, 2.0, 0.5, 3.0], dtype=torch.float64)
    res = synchronize([(v.moment, b) for v in views], W, mode, joint_rank=2)
    dense = [v.moment @ b.T for v in views]
    vbar_mean = sum(pi * d for pi, d in zip(P, dense))
    before = sum(float(pi * (d - vbar_mean).norm()) for pi, d in zip(P, dense)) / float(vbar_mean.norm())
    assert res.diagnostics["mismatch_before"] == pytest.approx(before, rel=1e-9)
    if mode == "none":
        assert res.diagnostics["mismatch_after"] == res.diagnostics["mismatch_before"]
        return
    st = res.state
    vbar = st.left @ st.core @ st.right.T
    after = sum(float(pi * (d - vbar).norm()) for pi, d in zip(P, dense)) / float(vbar.norm())
    assert res.diagnostics["mismatch_after"] == pytest.approx(after, rel=1e-8)
    assert res.diagnostics["removed_fraction"] == pytest.approx(float((vbar_mean - vbar).norm() / vbar_mean.norm()), rel=1e-7, abs=1e-10)


@pytest.mark.parametrize("shared", [True, False])
def test_diagnostics_off_gives_the_same_state_without_the_mismatch_diagnostics(shared):
    """``diagnostics=False`` (the run's switch, through RoundContext) only drops the mismatch
    diagnostics: the synchronised state is bit-identical."""
    views = _views(seed=13, shared=shared, weights=True)
    on = synchronize_moments(views, W, "ajive", joint_rank=2, seed=4)
    off = synchronize_moments(views, W, "ajive", joint_rank=2, seed=4, diagnostics=False)
    assert torch.equal(on.state.moment, off.state.moment) and torch.equal(on.state.weight, off.state.weight)
    assert {"mismatch_before", "mismatch_after", "removed_fraction"} <= set(on.diagnostics)
    assert not {"mismatch_before", "mismatch_after", "removed_fraction"} & set(off.diagnostics)
    assert off.diagnostics["joint_rank"] == on.diagnostics["joint_rank"]
