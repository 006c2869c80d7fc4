"""GaLoreAdamW's fast step path (issue 18): oneDNN projection, row-blocked decay + back-projection,
the folded bias correction, the fused plain-AdamW kernel and the non-finite guarantees — each
against a float64 reference of the documented rule or against torch."""
from __future__ import annotations

import math

import pytest
import torch

from fedgalore.optim import client_protocol
from fedgalore.optim import GaLoreAdamW, rebuild_delta
from fedgalore.optim import kernels as step_kernels
from fedgalore.optim import plain_adamw
from fedgalore.optim.projector import project

pytestmark = pytest.mark.isa  # numerically sensitive: make test runs it again with the CPU kernels forced down

LR, WD, B1, B2, EPS, SCALE = 1e-2, 0.1, 0.9, 0.999, 1e-8, 0.5
#: (m, n): right side (m >= n) and left side; the ``kernels`` fixture picks the kernels whatever the size
SHAPES = {"right": (384, 256), "left": (256, 640)}


@pytest.fixture(params=["avx2", "fast", "plain", "stacked"])
def kernels(request, monkeypatch):
    """``avx2``: the AVX2 kernels (fedgalore.optim.cpu_kernels, one thread) for every size;
    ``fast``: oneDNN projection for every size and small row blocks (several per matrix);
    ``plain``: torch.matmul and one unblocked mul_ + addmm_; ``stacked``: the bucket's GEMMs as
    ``bmm`` (group key ``bucket_gemm: stacked``, the CUDA default) and the multi-tensor weight update."""
    from fedgalore.optim import cpu_kernels
    from fedgalore.optim.galore_adamw import GALORE_DEFAULTS

    if request.param == "stacked":
        monkeypatch.setitem(GALORE_DEFAULTS, "bucket_gemm", "stacked")
        monkeypatch.setattr(cpu_kernels, "ENABLED", False)
        return request.param

    if request.param == "avx2":
        if not cpu_kernels.available():
            pytest.skip(f"AVX2 kernels unavailable: {cpu_kernels.reason()}")
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        request.addfinalizer(lambda: torch.set_num_threads(prev))
        monkeypatch.setattr(step_kernels, "ONEDNN_MIN_NUMEL", 0)
        return request.param
    monkeypatch.setattr(cpu_kernels, "ENABLED", False)
    if request.param == "fast":
        if step_kernels.onednn_linear() is None:
            pytest.skip("oneDNN projection unavailable in this torch build")
        monkeypatch.setattr(step_kernels, "ONEDNN_MIN_NUMEL", 0)
        monkeypatch.setattr(step_kernels, "BLOCK_BYTES", 4096)
    else:
        monkeypatch.setattr(step_kernels, "ONEDNN_MIN_NUMEL", 1 << 62)
        monkeypatch.setattr(step_kernels, "BLOCK_BYTES", 0)
    return request.param


def _grad(shape, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(*shape, generator=g)


def _param(shape, seed: int = 0) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(0.01 * torch.randn(*shape, generator=g))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _galore_opt(p, wd=WD, nonfinite="raise", **kw):
    group = {"params": [("w", p)], "rank": 8, "update_proj_gap": 10**6, "scale": SCALE, "projector": "random", **kw}
    return GaLoreAdamW([group], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=wd, nonfinite=nonfinite)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("wd", [WD, 0.0])
def test_step_matches_float64_reference(kernels, side, wd):
    shape = SHAPES[side]
    p = _param(shape)
    opt = _galore_opt(p, wd=wd)
    w = p.detach().double().clone()
    m = v = None
    for t in range(1, 7):
        p.grad = _grad(shape, t)
        opt.step()
        basis = opt.state[p].basis.double()
        g = p.grad.double()
        r = g @ basis.T if side == "right" else basis.T @ g
        m = (1 - B1) * r if m is None else B1 * m + (1 - B1) * r
        v = (1 - B2) * r * r if v is None else B2 * v + (1 - B2) * r * r
        u = m / (v.sqrt() / math.sqrt(1 - B2**t) + EPS)
        full = u @ basis if side == "right" else basis @ u
        w = (1 - LR * wd) * w - LR / (1 - B1**t) * SCALE * full
    w0 = _param(shape).detach().double()
    assert _rel(p.detach().double() - w0, w - w0) < 1e-5
    assert _rel(opt.state[p].exp_avg.double(), m) < 1e-5
    assert _rel(opt.state[p].exp_avg_sq.double(), v) < 1e-5


@pytest.mark.parametrize("side", ["right", "left"])
def test_compat_step_matches_float64_reference(kernels, side):
    """galore_torch_compat: update, then decay (folded into one decay + back-projection pass)."""
    shape = SHAPES[side]
    p = _param(shape)
    group = {"params": [("w", p)], "rank": 8, "update_proj_gap": 10**6, "scale": SCALE, "projector": "random"}
    opt = GaLoreAdamW([group], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, galore_torch_compat=True)
    client_protocol.mark(opt)
    w = p.detach().double().clone()
    w0 = w.clone()
    m = v = None
    for t in range(1, 7):
        p.grad = _grad(shape, t)
        opt.step()
        basis = opt.state[p].basis.double()
        g = p.grad.double()
        r = g @ basis.T if side == "right" else basis.T @ g
        m = (1 - B1) * r if m is None else B1 * m + (1 - B1) * r
        v = (1 - B2) * r * r if v is None else B2 * v + (1 - B2) * r * r
        u = m / (v.sqrt() + EPS)
        step = LR * math.sqrt(1 - B2**t) / (1 - B1**t)
        full = u @ basis if side == "right" else basis @ u
        w = (w - step * SCALE * full) * (1 - LR * WD)
    assert _rel(p.detach().double() - w0, w - w0) < 1e-5
    true = p.detach() - w0.float()
    assert _rel(rebuild_delta(client_protocol.export_update(opt)["w"], w0.float()), true) < 1e-5


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("mode", ["steps", "weight"])
def test_record_rebuilds_delta_with_track_cold(kernels, side, mode):
    """export_update() rebuilds W_T - W_0 to 1e-5 relative across refreshes, decay on, shadow
    cold moment on; with no warm start and step-count correction the cold record equals the
    record itself (with prior weights it differs after a refresh by design)."""
    shape = SHAPES[side]
    p = _param(shape)
    opt = _galore_opt(p, projector="rsvd_then_random", update_proj_gap=3, track_cold=True, bias_correction=mode)
    client_protocol.mark(opt)
    w0 = p.detach().clone()
    for t in range(8):
        p.grad = _grad(shape, t)
        opt.step()
    true = p.detach() - w0
    rebuilt = rebuild_delta(client_protocol.export_update(opt)["w"], w0)
    assert true.norm() > 0.5
    assert _rel(rebuilt, true) < 1e-5
    if mode == "steps":
        st = opt.state[p]
        assert _rel(st.record.cold, st.record.coef) < 1e-5
        d = client_protocol.moment_diagnostics(opt)["w"]
        assert d["update_norm_cold"] == pytest.approx(d["update_norm"], rel=1e-5)


def test_fast_and_plain_kernels_agree_with_warm_start_and_cold(monkeypatch):
    """A warm-started V (cold and warm directions differ): both kernel sets give the same
    parameter, record and diagnostics to fp32 rounding."""
    if step_kernels.onednn_linear() is None:
        pytest.skip("oneDNN projection unavailable in this torch build")
    out = {}
    for name, (numel, block) in {"fast": (0, 4096), "plain": (1 << 62, 0)}.items():
        monkeypatch.setattr(step_kernels, "ONEDNN_MIN_NUMEL", numel)
        monkeypatch.setattr(step_kernels, "BLOCK_BYTES", block)
        shape = SHAPES["right"]
        p = _param(shape)
        opt = _galore_opt(p, projector="random", update_proj_gap=4, track_cold=True)
        p.grad = _grad(shape, 0)
        opt.step()
        view = client_protocol.export_moments(opt)["w"]
        view = type(view)(view.moment * 3.0 + 1e-3, view.side, view.shape, view.basis, view.seed, view.weight)
        client_protocol.load_second_moment(opt, "w", view)
        client_protocol.mark(opt)
        w0 = p.detach().clone()
        for t in range(1, 7):
            p.grad = _grad(shape, t)
            opt.step()
        out[name] = (p.detach().clone(), rebuild_delta(client_protocol.export_update(opt)["w"], w0), client_protocol.moment_diagnostics(opt)["w"], w0)
    (pf, df, gf, w0), (pp, dp, gp, _) = out["fast"], out["plain"]
    assert _rel(pf - w0, pp - w0) < 1e-5
    assert _rel(df, pf - w0) < 1e-5
    assert _rel(df, dp) < 1e-5
    assert gf["update_norm_cold"] != pytest.approx(gf["update_norm"], rel=1e-3)  # warm start mattered
    for k in ("update_norm", "v_ratio_median"):
        assert gf[k] == pytest.approx(gp[k], rel=1e-5)
    # the cold direction divides the (warm) first moment by a fresh V: entries where R is near 0
    # amplify rounding (a 1e-7 relative perturbation of G moves this norm by ~2.5e-4 here)
    assert gf["update_norm_cold"] == pytest.approx(gp["update_norm_cold"], rel=1e-3)


def _blind_basis(opt, p, side):
    """Replace the basis by one with exact zeros: coordinates beyond the rank are never read."""
    st = opt.state[p]
    m, n = p.shape
    eye = torch.eye(n if side == "right" else m, 8)
    st.basis = eye.T.contiguous() if side == "right" else eye.contiguous()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_G_caught_through_zero_basis_entries(kernels, side, bad):
    """On a non-refresh step only R = G P^T is checked: a NaN/Inf entry of G that meets only
    zeros of the basis still makes R non-finite (IEEE NaN·0 = Inf·0 = NaN) and raises / skips."""
    shape = SHAPES[side]
    p = _param(shape)
    opt = _galore_opt(p)
    p.grad = _grad(shape, 0)
    opt.step()
    _blind_basis(opt, p, side)
    p.grad = _grad(shape, 1)
    p.grad[-1, -1] = bad
    with pytest.raises(FloatingPointError, match="'w'"):
        opt.step()

    q = _param(shape)
    opt = _galore_opt(q, nonfinite="skip")
    q.grad = _grad(shape, 0)
    opt.step()
    _blind_basis(opt, q, side)
    before = q.detach().clone()
    m_before = opt.state[q].exp_avg.clone()
    q.grad = _grad(shape, 1)
    q.grad[-1, -1] = bad
    opt.step()
    assert torch.equal(q.detach(), before) and torch.equal(opt.state[q].exp_avg, m_before)
    assert opt.state[q].skipped == 1 and opt.state[q].step == 1


def test_kernel_that_drops_nonfinite_gets_G_checked(monkeypatch):
    """A projection kernel that skips zero multiplicands fails the probe; the optimizer then
    checks G itself on every step (and would miss the NaN without that fallback)."""

    def skipping(g, basis, side):  # like a BLAS that skips zero multiplicands: non-finite entries vanish
        return project(torch.where(torch.isfinite(g), g, torch.zeros_like(g)), basis, side)

    monkeypatch.setattr(step_kernels, "project", skipping)
    monkeypatch.setattr(step_kernels, "ONEDNN_MIN_NUMEL", 1 << 62)
    assert not step_kernels.propagates_nonfinite(step_kernels.project, torch.device("cpu"))

    def run(kernels_cache):
        monkeypatch.setattr(step_kernels, "_KERNELS", kernels_cache)
        p = _param(SHAPES["right"])
        opt = _galore_opt(p)
        p.grad = _grad(p.shape, 0)
        opt.step()
        p.grad = _grad(p.shape, 1)
        p.grad[3, 5] = float("nan")
        opt.step()

    run({("matmul", "cpu"): True})  # pretending the kernel propagates: the NaN slips through
    with pytest.raises(FloatingPointError, match="'w'"):
        run({})  # probed: falls back to checking G


def test_probes_pass_on_this_build():
    assert step_kernels.propagates_nonfinite(project, torch.device("cpu"))
    if torch.backends.mkldnn.is_available():
        assert step_kernels.onednn_linear() is not None


# ----------------------------------------------------------------------------- plain groups
def _plain(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(50, 40, generator=g)) for _ in range(n)]


def _plain_grads(params, t):
    g = torch.Generator().manual_seed(500 + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_plain_group_matches_torch_adamw(wd):
    a, b = _plain(), _plain()
    opt = GaLoreAdamW(a, lr=1e-2, weight_decay=wd)
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=wd, foreach=False)
    for t in range(10):
        _plain_grads(a, t)
        _plain_grads(b, t)
        opt.step()
        ref.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[pa].exp_avg_sq, ref.state[pb]["exp_avg_sq"], rtol=1e-6, atol=1e-9)
        assert opt.state[pa].step == 10 and isinstance(opt.state[pa].step, int)


def test_plain_group_nonfinite_raise_and_skip_keep_per_parameter_semantics():
    params = _plain()
    opt = GaLoreAdamW([{"params": [("a", params[0]), ("b", params[1]), ("c", params[2])]}], lr=1e-2)
    before = [p.detach().clone() for p in params]
    _plain_grads(params, 0)
    params[1].grad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="'b'"):
        opt.step()
    assert not torch.equal(params[0], before[0])  # stepped before the bad one, as unbatched
    assert torch.equal(params[1], before[1]) and torch.equal(params[2], before[2])

    params = _plain()
    opt = GaLoreAdamW([{"params": [("a", params[0]), ("b", params[1]), ("c", params[2])]}], lr=1e-2, nonfinite="skip")
    before = [p.detach().clone() for p in params]
    _plain_grads(params, 0)
    params[1].grad[0, 0] = float("inf")
    opt.step()
    assert torch.equal(params[1], before[1]) and opt.state[params[1]].skipped == 1
    assert opt.state[params[1]].step == 0
    assert not torch.equal(params[0], before[0]) and not torch.equal(params[2], before[2])


def test_plain_bf16_parameter_takes_the_unfused_path():
    p = torch.nn.Parameter(torch.randn(8, 6).to(torch.bfloat16))
    q = torch.nn.Parameter(p.detach().float().clone())
    opt = GaLoreAdamW([p], lr=1e-2)
    ref = torch.optim.AdamW([q], lr=1e-2, foreach=False)
    for t in range(3):
        g = torch.randn(8, 6, generator=torch.Generator().manual_seed(t))
        p.grad, q.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
        opt.step()
        ref.step()
    assert not plain_adamw.fusable(p, p.grad, opt.param_groups[0])
    torch.testing.assert_close(p.float(), q, rtol=2e-2, atol=2e-2)
