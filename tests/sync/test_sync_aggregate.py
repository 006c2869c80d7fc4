"""FedGaLore's ``sync: aggregate`` (issue 41): S from the round's aggregated update, no moment upload.

What is checked, and against what:

* the server's state is the normalised square of the p̃-weighted sum of the clients' coefficient
  blocks on R_k (plus the floor), on R_k's seed — computed here from the uploads by hand;
* ``warm_scale="gradient"``: after the first step the prior's estimate has the shape the view
  gave it and the client's own scale (its mean is that of R∘R, before the step's own EMA update);
  a scale-free prior (×1000) gives the same step as the unscaled one;
* no upload carries a moment view; under ``privacy.client`` nothing is a second release (σ_m is
  none, ε is that of the update alone) and the option is accepted where ``moments: withheld``
  refuses the uploads-based sync;
* the combinations it cannot serve are one clear error each.
"""
from __future__ import annotations

import json

import pytest
import torch

import fedgalore
from fedgalore.optim import client_protocol
from fedgalore.methods.base import MethodError, get_method
from fedgalore.optim.galore_adamw import GaLoreAdamW
from fedgalore.protocol.bases import basis_seed
from fedgalore.protocol.payload import GaLoreUpdate, MomentView, Payload, SeededLowRank
from fedgalore.protocol.state import RoundContext, ServerState
from fedgalore_testing.runs import tiny_cfg  # noqa: E402


def test_state_is_the_normalised_square_of_the_aggregated_block_on_r_k():
    m = get_method("fedgalore", rank=3, projector="random", sync="aggregate")
    m.targets = ["w"]
    round_seed = 77
    seed = basis_seed(round_seed, "w", 0)
    g = torch.Generator().manual_seed(0)
    coefs = [torch.randn(8, 3, generator=g) for _ in range(3)]
    weights = [0.5, 0.3, 0.2]
    other = SeededLowRank(torch.randn(8, 3, generator=g) * 100, basis_seed(round_seed, "w", 1), "right", (8, 6))
    uploads = [Payload({"w": GaLoreUpdate(1.0, (SeededLowRank(c, seed, "right", (8, 6)), other), (8, 6))}, {})
               for c in coefs]
    state = ServerState()
    ctx = RoundContext(round=0, total_rounds=1, round_seed=round_seed, clients=[0, 1, 2], weights=weights)
    diags = m._sync_from_aggregate(state, uploads, weights, ctx)
    mean = sum(w * c for w, c in zip(weights, coefs))  # only the R_k term counts, not refresh 1's
    expect = mean ** 2 / (mean ** 2).mean() + 1e-3
    v = state.moments["w"]
    assert isinstance(v, MomentView) and v.seed == seed and v.basis is None and v.weight is None
    assert v.side == "right" and tuple(v.shape) == (8, 6)
    torch.testing.assert_close(v.moment, expect, rtol=1e-5, atol=1e-7)
    assert diags == {"aggregate_missing": 0.0}
    # a round whose uploads have no R_k term keeps the old state and says so
    off = [Payload({"w": GaLoreUpdate(1.0, (other,), (8, 6))}, {})]
    assert m._sync_from_aggregate(state, off, [1.0], ctx) == {"aggregate_missing": 1.0}
    assert state.moments["w"] is v


def _opt(scale: float, shape: torch.Tensor, weight: float = 0.2):
    """One aligned-protocol client on a seeded basis with a warm prior ``scale·shape`` at gradient scale."""
    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(12, 10, generator=g) * 0.1)
    x, y = torch.randn(32, 10, generator=g), torch.randn(32, 12, generator=g)
    opt = GaLoreAdamW([{"params": [("w", w)], "rank": 4, "update_proj_gap": 50, "projector": "random",
                        "moment_transfer": "squared", "bias_correction": "weight", "warm_scale": "gradient"}], lr=1e-2)
    opt.set_projection_seed(5)
    seed = client_protocol.view_seed(opt, "w")
    client_protocol.load_second_moment(opt, "w", MomentView(scale * shape, "right", (12, 10), None, seed, torch.full((4,), weight)))
    client_protocol.mark(opt)
    ((x @ w.T - y) ** 2).mean().backward()
    r = w.grad @ MomentView(shape, "right", (12, 10), None, seed).basis_matrix().T  # R = G Pᵀ (right side)
    opt.step()
    return opt, w, r


def test_gradient_warm_scale_keeps_the_shape_and_takes_the_clients_scale():
    shape = torch.rand(12, 4, generator=torch.Generator().manual_seed(1)) + 0.1
    opt, w, r = _opt(1.0, shape)
    st = opt.state[w]
    b2, c0 = 0.999, 0.2
    # after the step: V = β₂·(s·shape·c0) + (1−β₂)R², c = β₂c0 + (1−β₂); s = mean(R²)/mean(shape)
    s = float((r * r).mean()) / float(shape.mean())
    expect = b2 * s * shape * c0 + (1 - b2) * r * r
    torch.testing.assert_close(st.exp_avg_sq, expect, rtol=1e-4, atol=1e-12)
    assert client_protocol.moment_diagnostics(opt)["w"]["warm_rescale"] == pytest.approx(s, rel=1e-5)
    # the prior's own scale does not matter: ×1000 gives the same weights
    opt2, w2, _ = _opt(1000.0, shape)
    torch.testing.assert_close(w2.detach(), w.detach(), rtol=1e-5, atol=1e-7)


def test_gradient_warm_scale_needs_the_weight_rule():
    w = torch.nn.Parameter(torch.zeros(6, 5))
    with pytest.raises(ValueError, match="warm_scale='gradient'.*bias_correction='weight'"):
        GaLoreAdamW([{"params": [("w", w)], "rank": 2, "projector": "random", "warm_scale": "gradient"}])
    with pytest.raises(ValueError, match="unknown warm_scale"):
        GaLoreAdamW([{"params": [("w", w)], "rank": 2, "projector": "random", "bias_correction": "weight",
                      "moment_transfer": "squared", "warm_scale": "relative"}])


@pytest.mark.parametrize("options, match", [
    ({"projector": "random", "sync": "aggregate", "moment_protocol": "paper"}, "aligned protocol"),
    ({"projector": "random", "sync": "aggregate", "view_basis": "consensus"}, "view_basis='seeded'"),
    ({"projector": "rsvd", "sync": "aggregate"}, "ends on R_k"),
    ({"projector": "rsvd_then_random", "projector_schedule": "steps", "sync": "aggregate"}, "ends on R_k"),
])
def test_combinations_it_cannot_serve_are_one_clear_error(options, match):
    with pytest.raises(MethodError, match=match):
        get_method("fedgalore", rank=4, **options)


def test_default_projector_with_the_epoch_schedule_is_accepted():
    o = get_method("fedgalore", rank=4, sync="aggregate").options
    assert o.view_basis == "seeded" and o.projector_schedule == "epoch"


def _run(tmp_path, privacy=None, **options):
    # under privacy.client no weight decay (FedGaLore's decay·W0 term would sit outside the clip: refused) and fixed steps (its upload follows them)
    kw = {"privacy": privacy, "train": {"lr": 1e-2, "batch_size": 16, "local_steps": 4, "weight_decay": 0.0}} if privacy else {}
    cfg = tiny_cfg(tmp_path, "fedgalore", rounds=3, method_options={"projector": "random", "sync": "aggregate", **options},
                   output={"dir": str(tmp_path), "progress": "quiet"}, **kw)
    return fedgalore.run(cfg)


def test_a_federation_uploads_no_moments_and_warm_starts_from_the_aggregate(tmp_path):
    res = _run(tmp_path)
    diags = [json.loads(line) for line in (res.run_dir / "diagnostics.jsonl").read_text().splitlines()]
    assert [d["aggregate_missing"] for d in diags] == [0.0, 0.0, 0.0]
    # rounds 2, 3 start warm: the rescale factor is recorded, and no step is larger than a cold one
    assert all(d.get("warm_rescale", 0) > 0 for d in diags[1:]) and "warm_rescale" not in diags[0]
    assert all(d["update_ratio_max"] <= 1.0 + 1e-5 for d in diags)
    assert all(0 < d["update_norm_vs_cold"] <= 1.0 + 1e-6 for d in diags[1:])
    ledger = [json.loads(line) for line in (res.run_dir / "ledger.jsonl").read_text().splitlines()]
    up = [r for r in ledger if r["direction"] == "up"]
    down = [r for r in ledger if r["direction"] == "down" and r["round"] > 1]
    assert up and not any("moment" in k for r in up for k in r["tensor_bytes"])  # no client uploads a view
    assert down and all(any("moment" in k for k in r["tensor_bytes"]) for r in down)  # v̄ goes down


def test_under_client_dp_it_is_no_second_release(tmp_path):
    priv = {"client": {"clip": 0.5, "noise_multiplier": 1.0, "delta": 1e-5, "moments": "withheld"}}
    res = _run(tmp_path, privacy=priv)
    p = json.loads((res.run_dir / "privacy.json").read_text())["client"]
    assert p["moment_noise_multiplier"] is None
    from fedgalore.privacy.client_dp import client_epsilon

    # tiny_cfg: K = 3 of M = 6 sites per round, 3 rounds; ε of the update release alone
    assert p["epsilon"] == pytest.approx(client_epsilon([(1.0, 3, 3)], 6, 1e-5), rel=1e-6)
