"""GaLoreAdamW: AdamW limit, seeded bases, moment transfer, exact update record, warm start,
official-package compatibility, checkpoint round trip and bad input."""
from __future__ import annotations

import importlib
import io
import math
import sys
import types

import pytest
import torch

from fedgalore.optim import client_protocol
from fedgalore.optim.state import map_tensors
from fedgalore.optim import GaLoreAdamW, GaLoreStateEntry, rebuild_delta
from fedgalore.protocol.bases import basis_seed, seeded_basis
from fedgalore.protocol.payload import GaLoreUpdate, LowRank, MomentView, Payload, SeededLowRank, decode, encode

pytestmark = pytest.mark.isa  # numerically sensitive: make test runs it again with the CPU kernels forced down


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


class Problem:
    """Least squares ``||X W^T - Y||^2`` for a tall W (64x32), a wide W2 (24x48) and a bias."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32):
        g = _gen(seed)
        self.w = torch.nn.Parameter((0.3 * torch.randn(64, 32, generator=g)).to(dtype))
        self.w2 = torch.nn.Parameter((0.3 * torch.randn(24, 48, generator=g)).to(dtype))
        self.b = torch.nn.Parameter(torch.zeros(24, dtype=dtype))
        self.x = torch.randn(96, 32, generator=g)
        self.x2 = torch.randn(96, 48, generator=g)
        self.y = torch.randn(96, 64, generator=g)
        self.y2 = torch.randn(96, 24, generator=g)

    def params(self):
        return [self.w, self.w2, self.b]

    def grads(self, step: int = 0) -> None:
        for p in self.params():
            p.grad = None
        s = 1.0 + 0.1 * math.sin(step)  # vary the landscape a little per step
        out = self.x @ self.w.float().T
        out2 = self.x2 @ self.w2.float().T + self.b.float()
        loss = (out - s * self.y).pow(2).mean() + (out2 - self.y2).pow(2).mean()
        loss.backward()

    def state(self):
        return [p.detach().clone() for p in self.params()]


def _opt(pr: Problem, lr=1e-2, wd=0.1, **galore):
    groups = [
        {"params": [("w", pr.w), ("w2", pr.w2)], **galore},
        {"params": [("b", pr.b)]},
    ]
    return GaLoreAdamW(groups, lr=lr, weight_decay=wd)


def _galore(rank=4, tau=5, projector="random", **kw):
    return {"rank": rank, "update_proj_gap": tau, "scale": 1.0, "projector": projector, **kw}


# ----------------------------------------------------------------------------- AdamW limit
@pytest.mark.parametrize("proj_type", ["std", "left", "right"])
def test_identity_projector_equals_torch_adamw(proj_type):
    a, b = Problem(1), Problem(1)
    opt = _opt(a, **_galore(rank=1, tau=3, projector="identity", proj_type=proj_type))
    ref = torch.optim.AdamW(b.params(), lr=1e-2, weight_decay=0.1)
    for t in range(12):
        a.grads(t)
        b.grads(t)
        opt.step()
        ref.step()
    for pa, pb, p0 in zip(a.params(), b.params(), Problem(1).params()):
        assert (pa - p0).abs().max() > 1e-2  # it moved
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_full_rank_rotated_basis_is_not_adamw():
    """A full-rank random (rotated) basis spans everything but Adam is not rotation-invariant."""
    a, b = Problem(1), Problem(1)
    opt = _opt(a, **_galore(rank=64, tau=100, projector="random"))
    ref = torch.optim.AdamW(b.params(), lr=1e-2, weight_decay=0.1)
    for t in range(10):
        a.grads(t)
        b.grads(t)
        opt.step()
        ref.step()
    assert client_protocol.export_state(opt)["w"].rank == 32  # min(rank, m, n)
    rel = ((a.w - b.w).norm() / (b.w - Problem(1).w).norm()).item()
    assert rel > 0.05


# ----------------------------------------------------------------------------- seeded bases
def test_seeded_bases_follow_basis_seed_and_agree_across_instances():
    a, b = Problem(2), Problem(3)  # different data: clients differ, seeded bases must not
    oa = _opt(a, **_galore(rank=4, tau=2, projector="random"))
    ob = _opt(b, **_galore(rank=4, tau=2, projector="random"))
    for o in (oa, ob):
        o.set_projection_seed(777)
    bases = {}
    for t in range(5):  # refreshes at steps 0, 2, 4
        a.grads(t)
        b.grads(t)
        oa.step()
        ob.step()
        ea, eb = client_protocol.export_state(oa), client_protocol.export_state(ob)
        for name in ("w", "w2"):
            assert torch.equal(ea[name].basis, eb[name].basis)
            assert ea[name].seed == eb[name].seed
            q = ea[name].refresh_index
            assert q == t // 2
            side = ea[name].side
            m, n = ea[name].shape
            expected = seeded_basis(basis_seed(777, name, q), m, n, 4, side)
            assert ea[name].seed == basis_seed(777, name, q)
            assert torch.equal(ea[name].basis, expected)
            bases[(name, q)] = expected
    assert ea["w"].side == "right" and ea["w2"].side == "left"
    assert not torch.equal(bases[("w", 0)], bases[("w", 1)])
    assert not torch.equal(bases[("w", 1)], bases[("w", 2)])


def test_unnamed_params_fall_back_to_group_index_names():
    pr = Problem(0)
    opt = GaLoreAdamW([{"params": [pr.b]}, {"params": [pr.w, pr.w2], **_galore()}])
    assert set(client_protocol.export_state(opt)) == {"g1.p0", "g1.p1"}
    assert opt.param_name(pr.b) == "g0.p0"


def test_schedule_switches_after_adaptive_proj_steps_round_and_global_scope():
    def run(scope, offset, steps=7):
        pr = Problem(4)
        opt = _opt(pr, **_galore(tau=3, projector="rsvd_then_random", adaptive_proj_steps=2, adaptive_scope=scope))
        opt.set_projection_seed(5)
        opt.set_global_refresh_offset(offset)
        kinds = []
        for t in range(steps):
            pr.grads(t)
            opt.step()
            if t % 3 == 0:
                kinds.append("random" if client_protocol.export_state(opt)["w"].seed is not None else "data")
        return kinds

    assert run("round", 0) == ["data", "data", "random"]
    assert run("round", 10) == ["data", "data", "random"]  # offset ignored per round
    assert run("global", 1) == ["data", "random", "random"]
    assert run("global", 2) == ["random", "random", "random"]


def test_optimizer_never_touches_global_rng():
    pr = Problem(5)
    opt = _opt(pr, **_galore(tau=2, projector="rsvd_then_random", adaptive_proj_steps=1))
    state = torch.get_rng_state()
    for t in range(5):
        pr.grads(t)
        opt.step()
    assert torch.equal(torch.get_rng_state(), state)


# ----------------------------------------------------------------------------- moment transfer
@pytest.mark.parametrize("transfer", ["linear", "squared", "keep", "reset"])
def test_moment_transfer_at_refresh(transfer):
    pr = Problem(6)
    opt = _opt(pr, lr=1e-2, wd=0.0, **_galore(rank=4, tau=3, projector="random", moment_transfer=transfer))
    b1, b2 = 0.9, 0.999
    for t in range(3):
        pr.grads(t)
        opt.step()
    before = client_protocol.export_state(opt)
    pr.grads(3)
    grads = {"w": pr.w.grad.clone(), "w2": pr.w2.grad.clone()}
    opt.step()  # refresh q=1 happens inside this step
    after = client_protocol.export_state(opt)
    for name in ("w", "w2"):
        e0, e1 = before[name], after[name]
        p_old, p_new, side = e0.basis, e1.basis, e0.side
        g = grads[name]
        if side == "right":
            c, r = p_old @ p_new.T, g @ p_new.T
            mv = lambda x, cc: x @ cc  # noqa: E731
        else:
            c, r = p_new.T @ p_old, p_new.T @ g
            mv = lambda x, cc: cc @ x  # noqa: E731
        m_moved = mv(e0.exp_avg, c)
        # first moment: the part of the old full-space moment lying in span(P_new) is kept exactly
        lifted_old = e0.exp_avg @ p_old if side == "right" else p_old @ e0.exp_avg
        in_new = (lifted_old @ p_new.T) @ p_new if side == "right" else p_new @ (p_new.T @ lifted_old)
        lifted_moved = m_moved @ p_new if side == "right" else p_new @ m_moved
        torch.testing.assert_close(lifted_moved, in_new, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(e1.exp_avg, b1 * m_moved + (1 - b1) * r, atol=1e-7, rtol=1e-5)
        v0 = e0.exp_avg_sq
        if transfer == "linear":
            raw = mv(v0, c)
            assert (raw < 0).any()  # the literal rule does produce negatives ...
            v_moved = raw.clamp(min=0)  # ... which are clamped
        elif transfer == "squared":
            v_moved = mv(v0, c * c)
        elif transfer == "keep":
            v_moved = v0
        else:
            v_moved = torch.zeros_like(v0)
        torch.testing.assert_close(e1.exp_avg_sq, b2 * v_moved + (1 - b2) * r * r, atol=1e-9, rtol=1e-5)
        assert bool((e1.exp_avg_sq >= 0).all())
    if transfer == "reset":
        assert opt.state[pr.w].v_step == 1  # the cold v restarts its bias correction
        assert opt.state[pr.w].step == 4  # the first moment's counter does not


def test_squared_transfer_stays_nonnegative_over_many_refreshes():
    pr = Problem(7)
    opt = _opt(pr, **_galore(rank=3, tau=1, projector="random", moment_transfer="squared"))
    for t in range(25):
        pr.grads(t)
        opt.step()
        for e in client_protocol.export_state(opt).values():
            assert bool((e.exp_avg_sq >= 0).all())


# ----------------------------------------------------------------------------- update record
def _run_record(projector, steps=60, tau=7, compat=False, proj_type="std"):
    pr = Problem(8)
    groups = [
        {"params": [("w", pr.w), ("w2", pr.w2)], **_galore(rank=4, tau=tau, projector=projector,
                                                            adaptive_proj_steps=2, proj_type=proj_type)},
        {"params": [("b", pr.b)]},
    ]
    opt = GaLoreAdamW(groups, lr=3e-2, weight_decay=0.2, galore_torch_compat=compat, projection_seed=3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps)))
    for t in range(3):  # some steps before mark(): the record must start from W at mark()
        pr.grads(t)
        opt.step()
        sched.step()
    w0 = {"w": pr.w.detach().clone(), "w2": pr.w2.detach().clone()}
    client_protocol.mark(opt)
    for t in range(3, steps):
        pr.grads(t)
        opt.step()
        sched.step()
    return opt, pr, w0


@pytest.mark.parametrize("projector", ["rsvd_then_random", "svd", "identity"])
def test_update_record_rebuilds_exact_delta(projector):
    opt, pr, w0 = _run_record(projector)
    updates = client_protocol.export_update(opt)
    for name, w in (("w", pr.w), ("w2", pr.w2)):
        up = updates[name]
        true = w.detach() - w0[name]
        delta = rebuild_delta(up, w0[name])
        rel = ((delta - true).norm() / true.norm()).item()
        assert rel < 1e-5, (name, rel)
        assert true.norm() > 0.5
        assert up.decay < -0.05  # weight decay and the LR schedule went into the record
        kinds = [type(t) for t in up.terms]
        if projector == "rsvd_then_random":
            # refreshes at local steps 3, 10, ...: the first (data-driven) term was opened by mark()
            assert kinds.count(LowRank) == 2 and kinds.count(SeededLowRank) == 7
            assert all(t.coef.shape == ((64, 4) if name == "w" else (4, 48)) for t in up.terms
                       if isinstance(t, SeededLowRank))
        elif projector == "svd":
            assert kinds == [LowRank] * 9
        # the record survives the wire format
        back = decode(encode(Payload({name: up})))[name]
        assert isinstance(back, GaLoreUpdate)
        torch.testing.assert_close(rebuild_delta(back, w0[name]), delta)


def test_update_record_exact_in_compat_mode():
    opt, pr, w0 = _run_record("svd", compat=True)
    for name, w in (("w", pr.w), ("w2", pr.w2)):
        true = w.detach() - w0[name]
        rel = ((rebuild_delta(client_protocol.export_update(opt)[name], w0[name]) - true).norm() / true.norm()).item()
        assert rel < 1e-5


def test_export_update_requires_mark():
    pr = Problem(0)
    opt = _opt(pr, **_galore())
    with pytest.raises(RuntimeError, match="mark"):
        client_protocol.export_update(opt)


# ----------------------------------------------------------------------------- warm start
def _view_of(opt, name, **kw):
    return client_protocol.export_moments(opt, **kw)[name]


@pytest.mark.parametrize("shape_name", ["w", "w2"])
def test_lift_then_warm_start_on_the_same_basis_returns_v_exactly(shape_name):
    """Weight rule: a state exported on a basis and loaded by a client on that basis is the
    client's state again — coordinates and prior weights — and the next export returns it."""
    a, b = Problem(9), Problem(10)
    cfg = _galore(rank=4, tau=50, projector="random", projection_seed=42, bias_correction="weight")
    oa, ob = _opt(a, **cfg), _opt(b, **cfg)
    for t in range(4):
        a.grads(t)
        oa.step()
    b.grads(0)
    ob.step()  # b is on the same seeded basis (same round seed, refresh 0)
    va = _view_of(oa, shape_name)
    assert va.basis is None and va.seed == client_protocol.export_state(ob)[shape_name].seed
    torch.testing.assert_close(va.weight, torch.full((4,), 1 - 0.999**4))
    client_protocol.load_second_moment(ob, shape_name, va)
    st = client_protocol.export_state(ob)[shape_name]
    raw = client_protocol.export_state(oa)[shape_name].exp_avg_sq
    torch.testing.assert_close(st.exp_avg_sq, raw, atol=0, rtol=1e-6)  # c·(V/c) = V
    torch.testing.assert_close(st.v_weight, va.weight)
    vb = _view_of(ob, shape_name)
    torch.testing.assert_close(vb.moment, va.moment, atol=0, rtol=1e-6)
    torch.testing.assert_close(vb.weight, va.weight)
    assert client_protocol.moment_diagnostics(ob)[shape_name]["prior_retained"] == pytest.approx(1.0)


def _flip(view, j):
    """The same state on a basis whose j-th vector has the opposite sign (v is unchanged)."""
    p = view.basis_matrix().clone()
    if view.side == "right":
        p[j] = -p[j]
    else:
        p[:, j] = -p[:, j]
    return MomentView(view.moment, view.side, view.shape, p, None, view.weight)


@pytest.mark.parametrize("rule", ["weight", "steps"])
def test_warm_start_sign_flip_invariance(rule):
    """Flipping the sign of a basis vector describes the same second moment. The weight rule's
    squared transfer gives the same warm state; the paper's linear re-projection does not."""
    src = Problem(13)
    os_ = _opt(src, **_galore(rank=4, tau=50, projector="random", projection_seed=5, bias_correction="weight"))
    for t in range(3):
        src.grads(t)
        os_.step()
    view = _view_of(os_, "w")
    states = []
    for v in (view, _flip(view, 1)):
        pr = Problem(14)
        o = _opt(pr, **_galore(rank=4, tau=50, projector="svd", bias_correction=rule))
        client_protocol.load_second_moment(o, "w", v)  # pending: applied on the first (data-driven) basis
        pr.grads(0)
        o.step()
        states.append(client_protocol.export_state(o)["w"].exp_avg_sq)
    if rule == "weight":
        torch.testing.assert_close(states[0], states[1], atol=1e-9, rtol=1e-6)
    else:
        assert (states[0] - states[1]).abs().max() > 1e-6


def test_paper_warm_start_is_algorithm_1_as_written():
    """bias_correction='steps' (paper mode, Algorithm 1 line 3 + App. B): the synchronised buffer
    x on basis B is re-projected linearly onto the first basis P and clamped, V0 = max(x (B Pᵀ), 0);
    then AdamW runs as a freshly initialised optimizer: V1 = b2 V0 + (1 - b2) R², corrected by
    this round's step count, 1 / (1 - b2^1) — not used uncorrected (the earlier variant, ~20x
    larger first steps)."""
    pr = Problem(11)
    lr, eps, b1, b2 = 1e-2, 1e-8, 0.9, 0.999
    opt = _opt(pr, lr=lr, wd=0.0, **_galore(rank=4, tau=50, projector="random", projection_seed=1))
    g = _gen(12)
    x = torch.randn(64, 5, generator=g)
    b = torch.linalg.qr(torch.randn(32, 5, generator=g))[0].T  # (5 x 32), orthonormal rows
    client_protocol.load_second_moment(opt, "w", MomentView(x, "right", (64, 32), b))
    w_before = pr.w.detach().clone()
    pr.grads(0)
    grad = pr.w.grad.clone()
    opt.step()
    p = seeded_basis(basis_seed(1, "w", 0), 64, 32, 4, "right")
    v_loaded = (x @ (b @ p.T)).clamp(min=0)
    assert (x @ (b @ p.T) < 0).any()  # the clamp mattered
    assert client_protocol.moment_diagnostics(opt)["w"]["warm_clamped"] == pytest.approx(float((x @ (b @ p.T) < 0).float().mean()))
    rproj = grad @ p.T
    v = b2 * v_loaded + (1 - b2) * rproj * rproj
    m = (1 - b1) * rproj
    e = client_protocol.export_state(opt)["w"]
    torch.testing.assert_close(e.exp_avg_sq, v, atol=1e-5 * v.abs().max().item(), rtol=1e-5)
    expected = w_before - lr / (1 - b1) * (m / ((v / (1 - b2)).sqrt() + eps)) @ p
    torch.testing.assert_close(pr.w.detach(), expected, atol=1e-6, rtol=1e-5)
    uncorrected = w_before - lr / (1 - b1) * (m / (v.sqrt() + eps)) @ p
    assert (uncorrected - expected).abs().max() > 1e-3  # the rule is observable
    # the upload of Algorithm 1 line 10 is the raw buffer, no evidence
    up = client_protocol.export_moments(opt, buffer=True)["w"]
    assert up.weight is None and up.seed == basis_seed(1, "w", 0)
    torch.testing.assert_close(up.moment, e.exp_avg_sq, atol=0, rtol=0)


def test_weight_rule_warm_start_transfers_prior_weights_and_debiases():
    """bias_correction='weight': V = (c x)(C∘C), c' = c (C∘C) on the first basis; one step later
    c'' = b2 c' + (1 - b2) and the update divides by sqrt(V / c'')."""
    pr = Problem(15)
    lr, eps, b1, b2 = 1e-2, 1e-8, 0.9, 0.999
    opt = _opt(pr, lr=lr, wd=0.0, **_galore(rank=4, tau=50, projector="random", projection_seed=3, bias_correction="weight"))
    g = _gen(16)
    x = torch.rand(64, 4, generator=g)
    b = torch.linalg.qr(torch.randn(32, 4, generator=g))[0].T
    c = torch.tensor([0.2, 0.05, 0.5, 0.0])
    client_protocol.load_second_moment(opt, "w", MomentView(x, "right", (64, 32), b, None, c))
    w_before = pr.w.detach().clone()
    pr.grads(0)
    grad = pr.w.grad.clone()
    opt.step()
    p = seeded_basis(basis_seed(3, "w", 0), 64, 32, 4, "right")
    cc = (b @ p.T) ** 2
    v0, c0 = (x * c) @ cc, c[None, :] @ cc
    assert client_protocol.moment_diagnostics(opt)["w"]["prior_retained"] == pytest.approx(float(c0.sum() / c.sum()), rel=1e-5)
    r = grad @ p.T
    v, c1 = b2 * v0 + (1 - b2) * r * r, b2 * c0 + (1 - b2)
    e = client_protocol.export_state(opt)["w"]
    torch.testing.assert_close(e.exp_avg_sq, v, atol=1e-9, rtol=1e-5)
    torch.testing.assert_close(e.v_weight, c1.flatten(), atol=1e-9, rtol=1e-5)
    expected = w_before - lr / (1 - b1) * (((1 - b1) * r) / ((v / c1).sqrt() + eps)) @ p
    torch.testing.assert_close(pr.w.detach(), expected, atol=1e-6, rtol=1e-5)


def test_weight_rule_without_warm_start_is_adamw_bias_correction():
    """A cold weight-rule optimizer is the steps rule (c = 1 - b2^t), refreshes without transfer."""
    a, b = Problem(17), Problem(17)
    oa = _opt(a, **_galore(rank=4, tau=50, projector="svd", bias_correction="steps"))
    ob = _opt(b, **_galore(rank=4, tau=50, projector="svd", bias_correction="weight"))
    for t in range(12):
        a.grads(t)
        oa.step()
        b.grads(t)
        ob.step()
    for pa, pb in zip(a.params(), b.params()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(client_protocol.export_state(oa)["w"].v_weight, client_protocol.export_state(ob)["w"].v_weight)


@pytest.mark.parametrize("transfer,rule", [("squared", "weight"), ("linear", "steps"), ("squared", "steps")])
def test_export_moments_on_the_seeded_view_basis(transfer, rule):
    """export_moments(view_seeds) moves V (and its evidence) to R = seeded_basis(seed) by the
    transfer rule and carries the seed only; on R already it is V/c unchanged. Under the steps
    rule the evidence is the step count's 1 - b2^s on every coordinate, which no move changes."""
    pr = Problem(18)
    opt = _opt(pr, **_galore(rank=4, tau=50, projector="svd", moment_transfer=transfer, bias_correction=rule))
    for t in range(5):
        pr.grads(t)
        opt.step()
    st = client_protocol.export_state(opt)["w"]
    seed = client_protocol.view_seed(opt, "w")
    assert seed == basis_seed(0, "w", 0)
    view = client_protocol.export_moments(opt, {"w": seed, "w2": client_protocol.view_seed(opt, "w2")})["w"]
    assert view.basis is None and view.seed == seed
    r = seeded_basis(seed, 64, 32, 4, "right")
    c = st.basis @ r.T
    raw = (st.exp_avg_sq @ c).clamp(min=0) if transfer == "linear" else st.exp_avg_sq @ (c * c)
    w = st.v_weight[None, :] @ (c * c) if rule == "weight" else torch.full((1, 4), 1 - 0.999**5)
    torch.testing.assert_close(view.weight, w.flatten(), atol=1e-9, rtol=1e-5)
    torch.testing.assert_close(view.moment, raw / w, atol=1e-9, rtol=1e-4)
    own = client_protocol.export_moments(opt)["w"]
    torch.testing.assert_close(own.basis, st.basis)
    torch.testing.assert_close(own.moment, st.exp_avg_sq / st.v_weight[None, :])
    buf = client_protocol.export_moments(opt, {"w": seed}, buffer=True)["w"]  # Algorithm 1's raw buffer, moved the same way
    assert buf.weight is None
    torch.testing.assert_close(buf.moment, raw, atol=1e-9, rtol=1e-5)


def test_linear_transfer_with_per_coordinate_evidence_is_refused():
    pr = Problem(18)
    with pytest.raises(ValueError, match="moment_transfer='linear' cannot move per-coordinate evidence"):
        _opt(pr, **_galore(rank=4, moment_transfer="linear", bias_correction="weight"))
    with pytest.raises(ValueError, match="cap_to_cold .* needs bias_correction='weight'"):
        _opt(pr, **_galore(rank=4, cap_to_cold=True))


def test_track_cold_compares_with_the_cold_start_and_the_paper_rule_restarts_the_correction():
    """Shadow cold moment: without a warm start the update equals the cold one. With Algorithm 1's
    literal warm start a buffer close to 0 is a cold start again (the correction counts this
    round's steps), so it neither inflates nor shrinks the steps."""
    def run(rule, prior):
        pr = Problem(19)
        opt = _opt(pr, lr=1e-2, wd=0.0, **_galore(rank=4, tau=50, projector="svd", bias_correction=rule, track_cold=True))
        if prior is not None:
            client_protocol.load_second_moment(opt, "w", prior)
        client_protocol.mark(opt)
        for t in range(6):
            pr.grads(t)
            opt.step()
        return client_protocol.moment_diagnostics(opt)["w"], opt
    cold, opt = run("steps", None)
    assert cold["update_norm"] == pytest.approx(cold["update_norm_cold"], rel=1e-6)
    assert cold["v_ratio_median"] == pytest.approx(1.0, rel=1e-5)
    assert cold["update_ratio_max"] == pytest.approx(1.0, rel=1e-6) and cold["update_ratio_above"] == 0.0
    delta = client_protocol.export_update(opt)["w"].materialize()
    assert cold["update_norm"] == pytest.approx(float(delta.norm()), rel=1e-4)  # wd = 0: the whole update
    tiny = MomentView(torch.full((64, 4), 1e-12), "right", (64, 32), torch.eye(32)[:4])
    paper, _ = run("steps", tiny)
    assert paper["update_norm"] == pytest.approx(paper["update_norm_cold"], rel=1e-3)


def _prior_on_training_basis(scale: float, weight: float, seed: int = 7) -> MomentView:
    """A prior on the seeded basis the optimizer trains on at refresh 0 (``projection_seed=seed``),
    so the warm start keeps all of its evidence (the case that showed the inflation, issue 33)."""
    g = _gen(20)
    return MomentView(scale * torch.rand(64, 4, generator=g), "right", (64, 32), None, basis_seed(seed, "w", 0),
                      torch.full((4,), weight))


@pytest.mark.parametrize("cap", [False, True])
def test_aligned_prior_on_the_training_basis_never_steps_larger_than_cold_with_the_cap(cap):
    """The aligned rule with evidence c0 = 0.5 (n0 = 500 steps) and a prior far below E[g̃²]:
    uncapped, the first step's |U|/|U_cold| reaches about sqrt(1 + n0) on the coordinates the
    prior underestimates; with cap_to_cold no coordinate of any step exceeds 1."""
    pr = Problem(21)
    opt = _opt(pr, lr=1e-2, wd=0.0, **_galore(rank=4, tau=50, projector="random", bias_correction="weight",
                                               track_cold=True, cap_to_cold=cap))
    opt.set_projection_seed(7)
    client_protocol.load_second_moment(opt, "w", _prior_on_training_basis(1e-9, 0.5))
    client_protocol.mark(opt)
    for t in range(4):
        pr.grads(t)
        opt.step()
    d = client_protocol.moment_diagnostics(opt)["w"]
    assert d["prior_retained"] == pytest.approx(1.0, rel=1e-5)
    summary = client_protocol.update_ratio_summary(opt)
    if cap:
        assert summary["update_ratio_max"] <= 1.0 + 1e-6
        assert summary["update_ratio_above"] == 0.0 and summary["update_ratio_p99"] <= 1.0 + 1e-6  # rounding
        assert d["update_norm"] <= d["update_norm_cold"] * (1 + 1e-6)
    else:
        assert summary["update_ratio_max"] > 10  # ~ sqrt(1 + 500) at the first step
        assert summary["update_ratio_above"] > 0.5


def test_cold_cap_keeps_a_larger_prior():
    """The cap only removes inflation: where the prior is larger than the fresh estimate the
    aligned step stays smaller than a cold start's (the prior still conditions the step)."""
    pr = Problem(22)
    opt = _opt(pr, lr=1e-2, wd=0.0, **_galore(rank=4, tau=50, projector="random", bias_correction="weight",
                                               track_cold=True, cap_to_cold=True))
    opt.set_projection_seed(7)
    client_protocol.load_second_moment(opt, "w", _prior_on_training_basis(1e3, 0.5))
    client_protocol.mark(opt)
    pr.grads(0)
    opt.step()
    d = client_protocol.moment_diagnostics(opt)["w"]
    assert d["update_norm"] < 0.5 * d["update_norm_cold"]
    assert client_protocol.update_ratio_summary(opt)["update_ratio_max"] <= 1.0 + 1e-6


def test_load_second_moment_bad_input():
    pr = Problem(0)
    opt = _opt(pr, **_galore())
    good = MomentView(torch.zeros(64, 4), "right", (64, 32), torch.eye(32)[:4])
    with pytest.raises(KeyError):
        client_protocol.load_second_moment(opt, "nope", good)
    with pytest.raises(TypeError, match="MomentView"):
        client_protocol.load_second_moment(opt, "w", torch.zeros(64, 4))
    with pytest.raises(ValueError, match="does not fit"):
        client_protocol.load_second_moment(opt, "w", MomentView(torch.zeros(64, 4), "right", (64, 33), torch.eye(33)[:4]))
    with pytest.raises(ValueError, match="does not fit"):
        client_protocol.load_second_moment(opt, "w", MomentView(torch.zeros(63, 4), "right", (64, 32), torch.eye(32)[:4]))
    with pytest.raises(ValueError, match="not a GaLore"):
        client_protocol.load_second_moment(opt, "b", good)
    with pytest.raises(ValueError, match="negative prior"):
        client_protocol.load_second_moment(opt, "w", MomentView(torch.zeros(64, 4), "right", (64, 32), torch.eye(32)[:4], None, -torch.ones(4)))
    bad = torch.zeros(64, 4)
    bad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError):
        client_protocol.load_second_moment(opt, "w", MomentView(bad, "right", (64, 32), torch.eye(32)[:4]))


# ----------------------------------------------------------------------------- official compat
def _official_step(w, g, st, lr, b1, b2, eps, wd, rank, tau, scale):
    """The official galore_torch update written out (reference/algorithms.md §1.2)."""
    if st["t"] % tau == 0:
        u_, _, vh = torch.linalg.svd(g, full_matrices=False)
        st["P"] = vh[:rank] if w.shape[0] >= w.shape[1] else u_[:, :rank]
    p = st["P"]
    right = w.shape[0] >= w.shape[1]
    r = g @ p.T if right else p.T @ g
    if "m" not in st:
        st["m"], st["v"] = torch.zeros_like(r), torch.zeros_like(r)
    st["t"] += 1
    t = st["t"]
    st["m"] = b1 * st["m"] + (1 - b1) * r
    st["v"] = b2 * st["v"] + (1 - b2) * r * r
    step = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
    n = st["m"] / (st["v"].sqrt() + eps)
    w = w - step * scale * ((n @ p) if right else (p @ n))
    return w - lr * wd * w


def test_compat_matches_official_equations():
    pr = Problem(13)
    lr, eps, wd, scale = 1e-2, 1e-6, 0.05, 0.25
    groups = [{"params": [("w", pr.w), ("w2", pr.w2)], "rank": 4, "update_proj_gap": 3, "scale": scale,
               "proj_type": "std", "projector": "svd"}]
    opt = GaLoreAdamW(groups, lr=lr, eps=eps, weight_decay=wd, galore_torch_compat=True)
    ws = {"w": pr.w.detach().clone(), "w2": pr.w2.detach().clone()}
    sts = {"w": {"t": 0}, "w2": {"t": 0}}
    for t in range(10):
        pr.grads(t)
        for name, p in (("w", pr.w), ("w2", pr.w2)):
            ws[name] = _official_step(ws[name], p.grad, sts[name], lr, 0.9, 0.999, eps, wd, 4, 3, scale)
        opt.step()
    torch.testing.assert_close(pr.w.detach(), ws["w"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pr.w2.detach(), ws["w2"], atol=1e-6, rtol=1e-5)
    assert (pr.w.detach() - Problem(13).w).abs().max() > 1e-2


def _import_galore_torch():
    """galore_torch 1.0 imports bitsandbytes in its __init__ (8-bit variant only); stub it if absent."""
    try:
        return importlib.import_module("galore_torch.adamw")
    except ModuleNotFoundError as exc:
        if exc.name != "bitsandbytes" and not str(exc.name).startswith("bitsandbytes"):
            pytest.skip(f"galore_torch not importable: {exc}")
    stubs = {}
    for mod in ("bitsandbytes", "bitsandbytes.optim", "bitsandbytes.optim.optimizer"):
        if mod not in sys.modules:
            stubs[mod] = sys.modules[mod] = types.ModuleType(mod)
    sys.modules["bitsandbytes.optim.optimizer"].Optimizer2State = object  # type: ignore[attr-defined]
    try:
        return importlib.import_module("galore_torch.adamw")
    except Exception as exc:  # pragma: no cover
        pytest.skip(f"galore_torch not importable: {exc}")
    finally:
        for mod in stubs:
            sys.modules.pop(mod, None)


def test_compat_matches_galore_torch_package():
    official = _import_galore_torch()
    a, b = Problem(14), Problem(14)
    kw = {"rank": 4, "update_proj_gap": 3, "scale": 0.25, "proj_type": "std"}
    ours = GaLoreAdamW([{"params": [a.w, a.w2], **kw, "projector": "svd"}, {"params": [a.b]}],
                       lr=1e-2, eps=1e-6, weight_decay=0.05, galore_torch_compat=True)
    ref = official.AdamW([{"params": [b.w, b.w2], **kw}, {"params": [b.b]}],
                         lr=1e-2, eps=1e-6, weight_decay=0.05, no_deprecation_warning=True)
    for t in range(10):
        a.grads(t)
        b.grads(t)
        ours.step()
        ref.step()
    for pa, pb in zip(a.params(), b.params()):
        torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- checkpointing
def _walk_plain(x):
    if isinstance(x, torch.Tensor) or isinstance(x, (int, float, bool)) or x is None:
        return True
    if isinstance(x, dict):
        return all(isinstance(k, (str, int)) and _walk_plain(v) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return all(_walk_plain(v) for v in x)
    return False


@pytest.mark.parametrize("extra", [{}, {"bias_correction": "weight", "track_cold": True}])
def test_state_dict_round_trip_weights_only_and_bitwise_resume(extra):
    galore = _galore(rank=4, tau=3, projector="rsvd_then_random", adaptive_proj_steps=1, **extra)

    def make(pr):
        opt = _opt(pr, **galore)
        opt.set_projection_seed(9)
        return opt

    a = Problem(15)
    oa = make(a)
    if extra:  # a warm-started state (prior weights, warm diagnostics) survives the round trip too
        client_protocol.load_second_moment(oa, "w", MomentView(torch.rand(64, 4), "right", (64, 32), torch.eye(32)[:4], None, torch.full((4,), 0.3)))
    client_protocol.mark(oa)
    for t in range(5):
        a.grads(t)
        oa.step()
    sd = oa.state_dict()
    assert all(_walk_plain(s) for s in sd["state"].values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)

    b = Problem(15)
    for pb, pa in zip(b.params(), a.params()):
        pb.data.copy_(pa.detach())
    ob = make(b)
    ob.set_projection_seed(0)  # overwritten by the checkpoint's groups
    ob.load_state_dict(loaded)
    assert ob.param_groups[0]["projection_seed"] == 9
    for t in range(5, 12):
        a.grads(t)
        b.grads(t)
        oa.step()
        ob.step()
    for pa, pb in zip(a.params(), b.params()):
        assert torch.equal(pa, pb)
    assert client_protocol.moment_diagnostics(oa) == client_protocol.moment_diagnostics(ob)
    ua, ub = client_protocol.export_update(oa), client_protocol.export_update(ob)
    for name in ("w", "w2"):
        assert len(ua[name].terms) == len(ub[name].terms)
        assert torch.equal(rebuild_delta(ua[name], a.w if name == "w" else a.w2),
                           rebuild_delta(ub[name], b.w if name == "w" else b.w2))


def test_bf16_params_keep_fp32_state_and_checkpoint_dtype():
    pr = Problem(16, dtype=torch.bfloat16)
    opt = _opt(pr, **_galore(tau=2, projector="rsvd"))
    w0 = pr.w.detach().clone()
    for t in range(3):
        pr.grads(t)
        opt.step()
    assert pr.w.dtype == torch.bfloat16 and not torch.equal(pr.w, w0)
    e = client_protocol.export_state(opt)["w"]
    assert e.exp_avg.dtype == e.exp_avg_sq.dtype == e.basis.dtype == torch.float32
    opt2 = _opt(Problem(16, dtype=torch.bfloat16), **_galore(tau=2, projector="rsvd"))
    opt2.load_state_dict(opt.state_dict())
    assert client_protocol.export_state(opt2)["w"].exp_avg_sq.dtype == torch.float32
    assert isinstance(client_protocol.export_state(opt2)["w"], GaLoreStateEntry)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "override,match",
    [
        ({"rank": 0}, "rank"),
        ({"rank": -2}, "rank"),
        ({"rank": 2.5}, "rank"),
        ({"projector": "qr"}, "projector"),
        ({"proj_type": "full"}, "proj_type"),
        ({"moment_transfer": "rotate"}, "moment_transfer"),
        ({"adaptive_scope": "epoch"}, "adaptive_scope"),
        ({"bias_correction": "none"}, "bias_correction"),
        ({"update_proj_gap": 0}, "update_proj_gap"),
    ],
)
def test_bad_group_keys_raise(override, match):
    pr = Problem(0)
    with pytest.raises(ValueError, match=match):
        _opt(pr, **{**_galore(), **override})


def test_rank_on_non_2d_parameter_names_it():
    pr = Problem(0)
    with pytest.raises(ValueError, match="'bias'"):
        GaLoreAdamW([{"params": [("bias", pr.b)], "rank": 2}])
    with pytest.raises(ValueError, match="nonfinite"):
        GaLoreAdamW([pr.w], nonfinite="ignore")
    with pytest.raises(ValueError, match="duplicate"):
        GaLoreAdamW([{"params": [("x", pr.w)]}, {"params": [("x", pr.w2)]}])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_raises_with_name(bad):
    pr = Problem(0)
    opt = _opt(pr, **_galore(tau=2))
    for t in range(3):  # second call hits a non-refresh step
        pr.grads(t)
        if t == 2:
            pr.w2.grad[3, 5] = bad
            with pytest.raises(FloatingPointError, match="'w2'"):
                opt.step()
        else:
            opt.step()


def test_nonfinite_gradient_skip_policy_leaves_param_and_state_untouched():
    pr = Problem(0)
    opt = GaLoreAdamW([{"params": [("w", pr.w), ("w2", pr.w2)], **_galore(tau=2)}, {"params": [("b", pr.b)]}],
                      nonfinite="skip")
    pr.grads(0)
    opt.step()
    snapshot = pr.state()
    st = map_tensors(opt.state[pr.w], lambda v: v.clone())  # a snapshot of the typed state
    pr.grads(1)
    pr.w.grad[0, 0] = float("nan")
    pr.b.grad[0] = float("inf")
    opt.step()
    assert torch.equal(pr.w, snapshot[0]) and torch.equal(pr.b, snapshot[2])
    assert not torch.equal(pr.w2, snapshot[1])  # the finite parameter still stepped
    assert opt.state[pr.w].skipped == 1 and opt.state[pr.b].skipped == 1
    assert opt.state[pr.w].step == st.step
    assert torch.equal(opt.state[pr.w].exp_avg, st.exp_avg)
