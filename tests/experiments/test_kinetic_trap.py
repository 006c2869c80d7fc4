"""Tests for the kinetic-trap synthetic study (paper Appendix D)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from fedgalore.experiments import kinetic_trap as kt

pytestmark = pytest.mark.isa  # numerically sensitive: make test runs it again with the CPU kernels forced down

CFG = kt.TrapConfig()


@pytest.fixture(scope="module")
def land():
    return kt.make_landscape(CFG, trials=6, seed=11)


def _numerical_rank(M: torch.Tensor, rtol: float = 1e-10) -> torch.Tensor:
    """Per matrix of the batch, the number of singular values above ``rtol · σ_max``. Not
    ``torch.linalg.matrix_rank``'s default tolerance (``σ_max · max(m, n) · eps`` ≈ 2e-15·σ_max
    here): ``dW = W₁ − W₀`` carries rounding of ``W₀``'s scale (~1e-16·‖W₀‖ ≈ 2e-15·σ_max(dW)),
    which that default counted as rank or not depending on the CPU's BLAS kernels (issue 29)."""
    s = torch.linalg.svdvals(M)
    return (s > rtol * s[..., :1]).sum(-1)


def _rowspace_basis(A0):
    q, _ = torch.linalg.qr(A0.transpose(-1, -2))
    return q  # [T, d, r]


def test_directions_geometry(land):
    one = torch.ones(land.trials, dtype=torch.float64)
    torch.testing.assert_close(kt._inner(land.E1, land.E1), one)
    torch.testing.assert_close(kt._inner(land.E2, land.E2), one)
    torch.testing.assert_close(kt._inner(land.E1, land.E2), 0 * one, atol=1e-12, rtol=0)
    q = _rowspace_basis(land.A0)
    proj = q @ q.transpose(-1, -2)
    # E1's row space lies in rowspace(A0); E2 is orthogonal to every B·A0
    torch.testing.assert_close(land.E1 @ proj, land.E1, atol=1e-12, rtol=0)
    assert (land.E2 @ q).abs().max() < 1e-12
    bound = 1 / math.sqrt(CFG.d)
    assert land.A0.abs().max() <= bound


def test_w_ref_is_between_the_basins():
    b = CFG.b_ref
    assert 0 < b < CFG.c
    assert b == pytest.approx((math.sqrt(61) - 2) / 19, rel=1e-12)  # 19b² + 4b − 3 = 0
    nf = kt.make_landscape(replace(CFG, noise=0.0), trials=2, seed=0)
    l1, l2 = kt.basin_losses(nf.W0, nf)
    torch.testing.assert_close(l1, l2)
    # the paper's two basins: centres and curvatures
    l1c, l2c = kt.basin_losses(CFG.c * nf.E2, nf)
    torch.testing.assert_close(l1c, torch.zeros(2, dtype=torch.float64))
    expected = torch.full((2,), 0.5 * CFG.kappa_sharp * CFG.c**2, dtype=torch.float64)
    torch.testing.assert_close(l2c, expected)


def test_gradient_matches_autograd_and_finite_differences(land):
    g = torch.Generator().manual_seed(0)
    W = land.W0 + 0.3 * torch.randn(land.W0.shape, generator=g, dtype=torch.float64)
    Wg = W.clone().requires_grad_(True)
    kt.loss(Wg, land).sum().backward()
    torch.testing.assert_close(kt.grad(W, land), Wg.grad, atol=1e-12, rtol=1e-10)
    # central finite difference along a random direction
    D = torch.randn(W.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    h = 1e-5
    fd = (kt.loss(W + h * D, land) - kt.loss(W - h * D, land)) / (2 * h)
    torch.testing.assert_close(kt._inner(kt.grad(W, land), D), fd, atol=1e-7, rtol=1e-7)


def test_classifier_labels_the_centres(land):
    assert kt.classify(CFG.c * land.E2, land).all()
    assert not kt.classify(torch.zeros_like(land.W0), land).any()
    # near the centres too
    assert kt.classify(CFG.c * land.E2 + 0.05 * land.E1, land).all()
    assert not kt.classify(0.5 * land.E1, land).any()  # along the valley floor


def test_lora_first_step_only_moves_B_and_stays_in_rowspace(land):
    s = CFG.lora_scale
    B0 = torch.zeros(land.trials, CFG.d, CFG.rank, dtype=torch.float64)
    A1, B1 = kt.lora_step(land.A0, B0, land)
    torch.testing.assert_close(A1, land.A0, atol=0, rtol=0)  # ∇_A = s Bᵀ G = 0 at B = 0
    assert B1.abs().max() > 1e-3
    dW = s * B1 @ A1
    expected = -CFG.lr * s * s * kt.grad(land.W0, land) @ land.A0.transpose(-1, -2) @ land.A0
    torch.testing.assert_close(dW, expected)
    q = _rowspace_basis(land.A0)
    torch.testing.assert_close(dW @ q @ q.transpose(-1, -2), dW, atol=1e-14, rtol=0)
    # ... so the first step cannot move the orthogonal coordinate <W, E2>
    assert kt._inner(dW, land.E2).abs().max() < 1e-14
    # the second step moves A as well (B ≠ 0), which is how LoRA's subspace rotates
    A2, _ = kt.lora_step(A1, B1, land)
    assert (A2 - A1).abs().max() > 1e-6


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_galore_update_has_rank_at_most_r(rank):
    cfg = replace(CFG, rank=rank)
    land = kt.make_landscape(cfg, trials=4, seed=3)
    P = kt.galore_projector(kt.grad(land.W0, land), rank)
    assert P.shape == (4, rank, cfg.d)
    eye = torch.eye(rank, dtype=torch.float64).expand(4, -1, -1)
    torch.testing.assert_close(P @ P.transpose(-1, -2), eye)
    dW = kt.galore_step(land.W0, P, land) - land.W0
    assert (_numerical_rank(dW) <= rank).all()
    # ... while the gradient itself has higher rank
    assert (_numerical_rank(kt.grad(land.W0, land)) > rank).all()
    # the projected step keeps the top-r singular directions of the gradient
    G = kt.grad(land.W0, land)
    sv = torch.linalg.svdvals(G)[:, :rank]
    torch.testing.assert_close(torch.linalg.svdvals(dW)[:, :rank], CFG.lr * sv)


def test_galore_refresh_schedule(land, monkeypatch):
    calls = []
    orig = kt.galore_projector

    def spy(G, r):
        calls.append(1)
        return orig(G, r)

    monkeypatch.setattr(kt, "galore_projector", spy)
    kt.run_galore(land, steps=25)
    assert len(calls) == 3  # steps 0, 10, 20 with τ_proj = 10


def test_full_sgd_from_flat_centre_stays_and_converges(land):
    W = kt.run_full(replace(land, W0=CFG.c * land.E2 + 0.1 * land.E1), steps=400)
    assert kt.classify(W, land).all()
    torch.testing.assert_close(W, CFG.c * land.E2, atol=1e-3, rtol=0)


def test_tiny_run_is_deterministic_and_seed_dependent():
    cfg = replace(CFG, steps=200)
    a = kt.evaluate(cfg, trials=4, seed=5)
    b = kt.evaluate(cfg, trials=4, seed=5)
    for m in kt.METHODS:
        assert a[m]["flat"] == b[m]["flat"]
        assert a[m]["final_loss_median"] == b[m]["final_loss_median"]
    c = kt.evaluate(cfg, trials=4, seed=6)
    assert c["full"]["final_loss_median"] != a["full"]["final_loss_median"]
    # trial i depends only on (seed, i), not on the batch size
    l3 = kt.make_landscape(cfg, 3, seed=5)
    l5 = kt.make_landscape(cfg, 5, seed=5)
    torch.testing.assert_close(l3.W0, l5.W0[:3], atol=0, rtol=0)
    torch.testing.assert_close(l3.A0, l5.A0[:3], atol=0, rtol=0)


def test_no_global_rng_use():
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    kt.make_landscape(CFG, 3, seed=1)
    assert torch.equal(torch.rand(1), expected)


def test_wilson_interval():
    lo, hi = kt.wilson_interval(5, 10)
    assert (lo, hi) == (pytest.approx(0.236593, abs=1e-5), pytest.approx(0.763407, abs=1e-5))
    lo, hi = kt.wilson_interval(0, 10)
    assert lo == 0 and hi == pytest.approx(0.277533, abs=1e-5)
    assert kt.wilson_interval(200, 200)[1] == 1.0


def test_bad_config():
    with pytest.raises(ValueError, match="between the basins"):
        _ = replace(CFG, kappa_sharp=0.5).b_ref
    with pytest.raises(ValueError, match="rank"):
        kt.make_landscape(replace(CFG, rank=8), 2, 0)


def test_main_quick_writes_outputs(tmp_path, monkeypatch):
    monkeypatch.setattr(kt, "QUICK_SWEEPS", {"noise": [0.025]})
    assert kt.main(["--quick", "--trials", "3", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "kinetic_trap.json").read_text())
    assert data["trials"] == 3 and data["quick"] is True
    assert set(data["paper_frac_flat"]) == {"full", "galore", "lora"}
    for m in kt.METHODS:
        r = data["main"][m]
        assert 0 <= r["frac_flat"] <= 1 and r["trials"] == 3
        assert r["wilson95"][0] <= r["frac_flat"] <= r["wilson95"][1]
    assert "| LoRA |" in (tmp_path / "kinetic_trap.md").read_text()
    assert (tmp_path / "kinetic_trap.png").stat().st_size > 10_000
