"""The second moment's algebra (fedgalore.protocol.second_moment, DESIGN §3.1/§8): each rule
against its equation and its laws, and the server's evidence-weighted pooling end to end."""
from __future__ import annotations

import pytest
import torch

from fedgalore.protocol import second_moment as sm
from fedgalore.protocol.payload import MomentView
from fedgalore.sync import synchronize_moments, synchronize_moments_many

pytestmark = pytest.mark.isa  # numerically sensitive: make test runs it again with the CPU kernels forced down


def _orth(n: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))[0].T.contiguous()  # r × n rows


def _state(side: str, seed: int, m: int = 12, r: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    v = torch.rand((m, r) if side == "right" else (r, m), generator=g, dtype=torch.float64)
    c = torch.rand(sm.evidence_shape(side, r), generator=g, dtype=torch.float64) + 0.05
    return v, c


@pytest.mark.parametrize("side", ["right", "left"])
def test_observe_from_zero_is_adamws_bias_corrected_second_moment(side):
    """s steps from (0, 0): c = 1 − β₂^s and V / c = torch AdamW's exp_avg_sq / (1 − β₂^s)."""
    b2 = 0.99
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(6, 3, generator=g) for _ in range(5)]
    p = torch.nn.Parameter(torch.zeros(6, 3))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, b2), weight_decay=0.0)
    v, c = torch.zeros(6, 3), torch.zeros(sm.evidence_shape(side, 3 if side == "right" else 6))
    for s, grad in enumerate(grads, 1):
        p.grad = grad.clone()
        opt.step()
        v, c = sm.observe(v, c, grad, b2)
        torch.testing.assert_close(c, torch.full_like(c, 1 - b2**s))
        torch.testing.assert_close(sm.estimate(v, c), opt.state[p]["exp_avg_sq"] / (1 - b2**s), rtol=1e-6, atol=0)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("rule", ["squared", "keep", "reset"])
def test_move_by_the_identity_is_the_identity_and_results_are_nonnegative(side, rule):
    v, c = _state(side, 1)
    eye = torch.eye(4, dtype=torch.float64)
    v2, c2 = sm.move(v, c, eye, side, rule)
    if rule == "reset":
        assert not v2.any() and not c2.any()
        return
    torch.testing.assert_close(v2, v)
    torch.testing.assert_close(c2, c)
    lin, same = sm.move(v, c, eye, side, "linear", per_coordinate=False)
    torch.testing.assert_close(lin, v)
    assert same is c
    old, new = _orth(9, 4, 2), _orth(9, 4, 3)
    change = old @ new.T if side == "right" else (new @ old.T)  # C of change_of_basis (left: P_newᵀ P_old on columns)
    for rule2, per in (("squared", True), ("linear", False)):
        moved, _ = sm.move(v, c, change, side, rule2, per_coordinate=per)
        assert bool((moved >= 0).all())


@pytest.mark.parametrize("side", ["right", "left"])
def test_squared_move_is_sign_flip_invariant_and_linear_is_not(side):
    """Flipping the sign of a basis vector describes the same second moment: the squared rule
    (C∘C) gives the same state, the paper's linear reprojection does not."""
    v, c = _state(side, 4)
    old, new = _orth(9, 4, 5), _orth(9, 4, 6)
    flipped = old.clone()
    flipped[1] = -flipped[1]
    for rule, per in (("squared", True), ("linear", False)):
        outs = []
        for basis in (old, flipped):
            change = basis @ new.T
            change = change if side == "right" else change.T
            outs.append(sm.move(v, c, change, side, rule, per_coordinate=per))
        same = torch.allclose(outs[0][0], outs[1][0]) and torch.allclose(outs[0][1], outs[1][1])
        assert same == (rule == "squared")


def test_linear_move_of_per_coordinate_evidence_is_refused():
    v, c = _state("right", 7)
    with pytest.raises(ValueError, match="moment_transfer='squared'"):
        sm.move(v, c, torch.eye(4, dtype=torch.float64), "right", "linear")


def test_squared_move_gives_no_evidence_to_a_direction_the_old_basis_misses():
    """A new basis vector orthogonal to the old span gets c = 0 (so no estimate: fresh gradients
    set its scale); one inside the span keeps the evidence."""
    old = torch.eye(6, dtype=torch.float64)[:2]  # e0, e1
    new = torch.eye(6, dtype=torch.float64)[[1, 4]]  # e1 (in the span), e4 (outside)
    v, c = torch.ones(3, 2, dtype=torch.float64), torch.tensor([[0.4, 0.7]], dtype=torch.float64)
    v2, c2 = sm.move(v * c, c, old @ new.T, "right", "squared")
    torch.testing.assert_close(c2, torch.tensor([[0.7, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(sm.estimate(v2, c2), torch.tensor([[1.0, 0.0]] * 3, dtype=torch.float64))


def test_pool_laws_and_the_evidence_free_client():
    """Pooling K copies of an estimate returns it; the weights are scale-invariant; a client with
    (almost) no evidence for a coordinate does not drag it: 1 with c = 0.5 and 100 with c = 1e-6
    pool to ≈ 1 (50.5 by client weight alone)."""
    v, c = _state("right", 8)
    e = sm.estimate(v, c)
    for k in (1, 3):
        got, cbar = sm.pool([e] * k, [c] * k, [1.0] * k)
        torch.testing.assert_close(got, e)
        torch.testing.assert_close(cbar, c)
    v2, c2 = _state("right", 9)
    e2 = sm.estimate(v2, c2)
    a = sm.pool([e, e2], [c, c2], [1.0, 3.0])
    b = sm.pool([e, e2], [c, c2], [0.25, 0.75])
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    ones = torch.ones(1, 1, dtype=torch.float64)
    pooled, cbar = sm.pool([ones, 100 * ones], [0.5 * ones, 1e-6 * ones], [0.5, 0.5])
    assert float(pooled) == pytest.approx(1.0, abs=1e-3)
    assert float(sm.pool([ones, 100 * ones], None, [0.5, 0.5])[0]) == pytest.approx(50.5)
    zero = torch.zeros(1, 1, dtype=torch.float64)  # no evidence anywhere: the plain weighted mean
    assert float(sm.pool([ones, 3 * ones], [zero, zero], [0.5, 0.5])[0]) == pytest.approx(2.0)


def test_warm_starts():
    """Aligned: exact on the state's own basis (estimate back, evidence back); paper: Algorithm 1
    line 3, the buffer re-projected linearly and clamped."""
    x = torch.tensor([[0.5, -0.1], [2.0, 1.0]], dtype=torch.float64)
    c = torch.tensor([0.3, 0.9], dtype=torch.float64)
    v, ev = sm.warm_aligned(x, c, torch.eye(2, dtype=torch.float64), "right", "squared")
    torch.testing.assert_close(sm.estimate(v, ev), x.clamp(min=0))
    torch.testing.assert_close(ev.flatten(), c)
    change = torch.tensor([[0.6, -0.8], [0.8, 0.6]], dtype=torch.float64)
    torch.testing.assert_close(sm.warm_paper(x, change, "right"), (x @ change).clamp(min=0))


def _view(value: float, evidence: float | None, basis: torch.Tensor) -> MomentView:
    return MomentView(torch.full((40, 4), value, dtype=torch.float64), "right", (40, 9), basis, None,
                      None if evidence is None else torch.full((4,), evidence, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["mean", "ajive"])
def test_the_server_pools_estimates_by_their_evidence(mode):
    """Issue 33: client A's estimate 1 with c = 0.5 and client B's 100 with c = 1e-6, equal client
    weights: v̄ ≈ 1 (it was 50.5), per matrix and batched alike; c̄ = Σ p_i c_i."""
    basis = _orth(9, 4, 10)
    views = [_view(1.0, 0.5, basis), _view(100.0, 1e-6, basis)]
    ref = synchronize_moments(views, [0.5, 0.5], mode, joint_rank=1)
    torch.testing.assert_close(ref.state.moment, torch.ones(40, 4, dtype=torch.float64), rtol=1e-3, atol=0)
    torch.testing.assert_close(ref.state.weight, torch.full((4,), 0.25 + 5e-7, dtype=torch.float64))
    if mode == "ajive":
        g = torch.Generator().manual_seed(11)
        # several matrices of one shape: the batched path (the reference refuses constant views' joint space
        # no differently, but noise makes the views generic)
        items = [[MomentView(v.moment + 1e-3 * torch.rand(40, 4, generator=g, dtype=torch.float64), v.side, v.shape,
                             v.basis, None, v.weight) for v in views] for _ in range(3)]
        many = synchronize_moments_many(items, [0.5, 0.5], "ajive", joint_rank=1)
        for it, res in zip(items, many):
            one = synchronize_moments(it, [0.5, 0.5], "ajive", joint_rank=1)
            torch.testing.assert_close(res.state.moment, one.state.moment, rtol=1e-6, atol=1e-9)
            assert float(res.state.moment.mean()) == pytest.approx(1.0, abs=0.01)
