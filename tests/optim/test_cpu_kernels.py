"""The AVX2 kernels of the GaLore step (fedgalore.optim.cpu_kernels): equal to torch's products to
fp32 rounding at ragged shapes, NaN/Inf propagate (the optimizer's non-finite check relies on it),
the optimizer steps the same with and without them, and every reason not to use them falls back
to torch with the reason stated."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from fedgalore.optim import client_protocol
from fedgalore.optim import GaLoreAdamW, cpu_kernels, rebuild_delta
from fedgalore.optim import kernels

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"AVX2 kernels unavailable: {cpu_kernels.reason()}")


@pytest.fixture
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def _basis(gen, side, m, n, r):
    if side == "right":
        return torch.linalg.qr(torch.randn(n, r, generator=gen))[0].T.contiguous()
    return torch.linalg.qr(torch.randn(m, r, generator=gen))[0].contiguous()


SHAPES = [(1, 8, 8), (12, 31, 8), (25, 40, 16), (97, 75, 8), (130, 257, 16), (40, 1000, 8)]


@needs_kernels
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("m,n,r", SHAPES)
def test_kernels_equal_the_float64_products(side, m, n, r, one_thread):
    gen = torch.Generator().manual_seed(m * n + r)
    if side == "right" and r > n or side == "left" and r > m:
        pytest.skip("rank above the basis dimension")
    g = torch.randn(m, n, generator=gen)
    p = _basis(gen, side, m, n, r)
    ref = g.double() @ p.double().T if side == "right" else p.double().T @ g.double()
    got = cpu_kernels.project(g, p, side)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6
    u = torch.randn(m, r, generator=gen) if side == "right" else torch.randn(r, n, generator=gen)
    w = torch.randn(m, n, generator=gen)
    full = u.double() @ p.double() if side == "right" else p.double() @ u.double()
    ref_w = 0.97 * w.double() - 0.013 * full  # the decay is applied once, also at r = 16 (two passes of 8)
    cpu_kernels.decay_back_project(w, u, p, side, 0.97, -0.013)
    assert float((w.double() - ref_w).norm() / ref_w.norm()) < 1e-6


@needs_kernels
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_projection_propagates_nonfinite_where_the_basis_is_zero(side, bad, one_thread):
    """A NaN/Inf gradient entry makes its row (right) / column (left) of R non-finite even where
    it meets zeros of the basis — the optimizer checks only R for it."""
    m, n, r = 50, 37, 8
    g = torch.ones(m, n)
    g[17, 23] = bad
    eye = torch.eye(n if side == "right" else m, r)  # zero beyond the first r coordinates
    p = eye.T.contiguous() if side == "right" else eye.contiguous()
    out = cpu_kernels.project(g, p, side)
    finite = torch.isfinite(out)
    if side == "right":
        assert not bool(finite[17].any()) and bool(finite[torch.arange(m) != 17].all())
    else:
        assert not bool(finite[:, 23].any()) and bool(finite[:, torch.arange(n) != 23].all())


@needs_kernels
@pytest.mark.parametrize("wd,extra", [(0.0, {}), (0.01, {}), (0.01, {"bias_correction": "weight", "track_cold": True})])
def test_optimizer_steps_the_same_with_and_without_the_kernels(wd, extra, one_thread, monkeypatch):
    """GaLoreAdamW on matrices large enough for the kernels (both sides, rank 8): three steps with
    them equal three steps with torch to fp32 rounding; a non-finite gradient is skipped (policy
    ``skip``) on the kernel path as on torch's."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(768, 512), (512, 768)]  # right, left; 393,216 entries >= ONEDNN_MIN_NUMEL
    assert all(m * n >= kernels.ONEDNN_MIN_NUMEL for m, n in shapes)
    init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    bad = [g.clone() for g in grads[1]]
    bad[0][5, 7] = float("nan")
    calls = {"project": 0, "decay_back_project": 0, "adam_moments": 0}
    for name in calls:
        fn = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _fn=fn, _name=name, **k: (calls.__setitem__(_name, calls[_name] + 1), _fn(*a, **k))[1])
    out = {}
    for on in (True, False):
        with contextlib.nullcontext() if on else cpu_kernels.disabled():
            ps = [torch.nn.Parameter(x.clone()) for x in init]
            opt = GaLoreAdamW([{"params": [(f"w{i}", p) for i, p in enumerate(ps)], "rank": 8, "projector": "rsvd_then_random",
                                "update_proj_gap": 200, "scale": 0.25, "nonfinite": "skip", **extra}], lr=1e-2, weight_decay=wd)
            client_protocol.mark(opt)  # the update record on, as in every federated round
            for step, gs in enumerate([grads[0], bad, grads[2]]):
                for p, g in zip(ps, gs):
                    p.grad = g.clone()
                opt.step()
            upd = client_protocol.export_update(opt)
            out[on] = ([p.detach().clone() for p in ps], [opt.state[p].skipped for p in ps],
                       [rebuild_delta(upd[f"w{i}"], x) for i, x in enumerate(init)], client_protocol.moment_diagnostics(opt))
    # with the kernels: 2 matrices x 3 steps projected and through the moment kernel (the NaN step
    # is refused there), the skipped one not back-projected; without them: no call
    assert calls == {"project": 6, "decay_back_project": 5, "adam_moments": 6}
    assert cpu_kernels.ENABLED  # restored after the block
    (p_on, skip_on, d_on, g_on), (p_off, skip_off, d_off, g_off) = out[True], out[False]
    assert skip_on == skip_off == [1, 0]
    for a, b, x, da, db in zip(p_on, p_off, init, d_on, d_off):
        assert float((a - b).norm() / (b - x).norm()) < 1e-5  # relative to the change the steps made
        assert float((da - db).norm() / db.norm()) < 1e-5 and float((da - (a - x)).norm() / (a - x).norm()) < 1e-5
    for name in g_off:
        for key in ("update_norm", "update_norm_cold"):
            if key in g_off[name]:
                assert g_on[name][key] == pytest.approx(g_off[name][key], rel=1e-4)


def test_usable_only_where_measured_faster(one_thread):
    f = torch.randn(64, 48)
    p8 = torch.randn(8, 48)
    assert cpu_kernels.usable(f, p8) == cpu_kernels.available()
    assert not cpu_kernels.usable(f, torch.randn(32, 48))  # rank 32: MKL/oneDNN win
    assert not cpu_kernels.usable(f, torch.randn(6, 48))  # not a multiple of 8
    assert not cpu_kernels.usable(f.T, p8.T.contiguous().T)  # not contiguous
    assert not cpu_kernels.usable(f.bfloat16(), p8)
    torch.set_num_threads(2)
    assert not cpu_kernels.usable(f, p8)  # several threads: the libraries use them all


def _probe_in_subprocess(env_extra: dict[str, str], tmp_path) -> tuple[str, str]:
    env = {**os.environ, "FEDGALORE_CACHE": str(tmp_path / "cache"), **env_extra}
    code = ("from fedgalore.optim import cpu_kernels as k, GaLoreAdamW\n"
            "import torch; torch.set_num_threads(1)\n"
            "p = torch.nn.Parameter(torch.randn(600, 512)); p.grad = torch.randn(600, 512)\n"
            "GaLoreAdamW([{'params': [p], 'rank': 8}]).step()\n"
            "print(k.available()); print(k.reason())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    avail, why = out.stdout.strip().splitlines()[-2:]
    return avail, why


def test_turned_off_by_the_environment_and_the_optimizer_still_steps(tmp_path):
    avail, why = _probe_in_subprocess({"FEDGALORE_CPU_KERNELS": "0"}, tmp_path)
    assert avail == "False" and "FEDGALORE_CPU_KERNELS=0" in why


@pytest.mark.skipif(cpu_kernels._supported() is not None, reason="no AVX2 x86-64 here")
def test_a_failing_compiler_falls_back_to_torch_with_the_reason(tmp_path):
    avail, why = _probe_in_subprocess({"CC": "/bin/false"}, tmp_path)
    assert avail == "False" and "/bin/false failed" in why
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))  # nothing half-written is left


@needs_kernels
def test_built_once_into_the_cache_folder(tmp_path):
    avail, why = _probe_in_subprocess({}, tmp_path)
    assert avail == "True" and why == "None"
    libs = list((tmp_path / "cache" / "kernels").glob("rank_r_avx2-*.so"))
    assert len(libs) == 1
    stamp = libs[0].stat().st_mtime_ns
    assert _probe_in_subprocess({}, tmp_path)[0] == "True"
    assert libs[0].stat().st_mtime_ns == stamp and len(list((tmp_path / "cache" / "kernels").iterdir())) == 1


@needs_kernels
@pytest.mark.parametrize("rows,cols,weight", [(40, 8, "col"), (8, 45, "row"), (3, 5, None), (17, 16, "col")])
@pytest.mark.parametrize("b1", [0.9, 0.3])
def test_adam_moments_follow_torchs_formulas_and_refuse_nonfinite(rows, cols, weight, b1):
    """The moment kernel equals the optimizer's torch ops (lerp_, mul_ + addcmul_, the prior
    weight c, U) to fp32 rounding — 1 − β computed in double as torch's scalars (an fp32 1 − 0.999
    is off by 1.3e-5) — and leaves every tensor untouched when R has a NaN/Inf."""
    gen = torch.Generator().manual_seed(rows * cols)
    b2, eps = 0.999, 1e-8
    r = torch.randn(rows, cols, generator=gen)
    m0, v0 = torch.randn(rows, cols, generator=gen), torch.rand(rows, cols, generator=gen)
    w0 = None if weight is None else torch.rand((rows, 1) if weight == "row" else (1, cols), generator=gen) + 0.1
    m, v, cv = m0.clone(), v0.clone(), v0.clone() * 0.5
    w8 = None if w0 is None else w0.clone()
    u = cpu_kernels.adam_moments(r, m, v, b1, b2, eps, cold_v=cv, v_weight=w8)
    mt, vt, cvt = m0.clone().lerp_(r, 1.0 - b1), v0.clone().mul_(b2).addcmul_(r, r, value=1.0 - b2), (v0 * 0.5).mul_(b2).addcmul_(r, r, value=1.0 - b2)
    if w0 is not None:
        wt = w0.clone().mul_(b2).add_(1.0 - b2)
        ut = mt / (vt / wt).sqrt_().add_(eps)
        assert torch.allclose(w8, wt, rtol=1e-6, atol=0)
    else:
        ut = mt / vt.sqrt().add_(eps)
    for got, ref in ((m, mt), (v, vt), (cv, cvt), (u, ut)):
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-6
    for bad in (float("nan"), float("inf"), float("-inf")):
        rb = r.clone()
        rb[rows // 2, cols - 1] = bad
        before = [t.clone() for t in (m, v, cv)] + ([] if w8 is None else [w8.clone()])
        assert cpu_kernels.adam_moments(rb, m, v, b1, b2, eps, cold_v=cv, v_weight=w8) is None
        assert all(torch.equal(a, b) for a, b in zip(before, [m, v, cv] + ([] if w8 is None else [w8])))


@needs_kernels
@pytest.mark.parametrize("rows,cols,weight", [(40, 8, "col"), (8, 45, "row"), (17, 16, "col")])
def test_adam_moments_cold_cap_follows_the_optimizer(rows, cols, weight):
    """With ``cold_cap = 1/(1 − β₂^s)`` the kernel's denominator is ``√max(V/c, cap·V_cold) + eps``
    (the aligned protocol's cap, GaLoreAdamW ``cap_to_cold``), equal to the torch ops; the warm
    estimate wins where it is larger, the cold one elsewhere (both occur here)."""
    gen = torch.Generator().manual_seed(rows + cols)
    b1, b2, eps, cap = 0.9, 0.999, 1e-8, 1.0 / (1.0 - 0.999**3)
    r = torch.randn(rows, cols, generator=gen)
    m0, v0 = torch.randn(rows, cols, generator=gen), torch.rand(rows, cols, generator=gen)
    cv0 = torch.rand(rows, cols, generator=gen) * 1e-3
    w0 = torch.rand((rows, 1) if weight == "row" else (1, cols), generator=gen) + 0.1
    m, v, cv, w8 = m0.clone(), v0.clone(), cv0.clone(), w0.clone()
    u = cpu_kernels.adam_moments(r, m, v, b1, b2, eps, cold_v=cv, v_weight=w8, cold_cap=cap)
    mt, vt = m0.clone().lerp_(r, 1.0 - b1), v0.clone().mul_(b2).addcmul_(r, r, value=1.0 - b2)
    cvt, wt = cv0.clone().mul_(b2).addcmul_(r, r, value=1.0 - b2), w0.clone().mul_(b2).add_(1.0 - b2)
    warm, cold = vt / wt, cvt * cap
    assert bool((warm > cold).any()) and bool((cold > warm).any())
    ut = mt / torch.maximum(warm, cold).sqrt_().add_(eps)
    for got, ref in ((m, mt), (v, vt), (cv, cvt), (u, ut)):
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-6
