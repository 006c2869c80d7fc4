"""The projector schedule by local epoch (issue 40, defect 1; paper §4 "SVD-to-random projectors",
App. E): data-driven (RSVD) bases for the first ``adaptive_epochs`` local epochs, the round's
seeded basis R_k for the rest, so every client ends the round on R_k — the basis Algorithm 1's
views ṽ R_kᵀ need — and its second moment travels unmoved. The step-count schedule (τ larger than
a client-round) never left RSVD, and every upload was moved onto an unrelated R_k."""
from __future__ import annotations

import json

import pytest
import torch

import fedgalore
from fedgalore.optim import client_protocol, moment_exchange
from fedgalore.federated.client import epoch_switch_step
from fedgalore.methods.base import MethodError, get_method
from fedgalore.optim.galore_adamw import GaLoreAdamW
from fedgalore.protocol.bases import basis_seed
from fedgalore.protocol.payload import LowRank, SeededLowRank

from fedgalore_testing.runs import tiny_cfg


@pytest.mark.parametrize("n,b,k,epochs,total,expect", [
    (36, 16, 1, 1.0, 5, 3),    # E = 2 over 36 examples: batches start at 0, 16, 32 | 48, 64: step 3 is the first of epoch 2
    (32, 16, 1, 1.0, 4, 2),    # epoch boundary on a batch boundary
    (20, 16, 1, 1.0, 3, 2),    # the boundary inside batch 1: it stays data-driven
    (10, 16, 1, 1.0, 2, 1),
    (5, 16, 1, 1.0, 1, 0),     # one step: it runs on R_k (the round ends there)
    (36, 16, 2, 1.0, 3, 2),    # 3 micro-batches of epoch 1 -> optimizer step 2
    (100, 10, 1, 0.5, 10, 5),  # E = 1, half an epoch data-driven
    (100, 10, 1, 0.0, 10, 0),  # R_k from the start
    (100, 10, 1, 3.0, 20, 19),  # beyond the round: the last step still on R_k
])
def test_epoch_switch_step(n, b, k, epochs, total, expect):
    assert epoch_switch_step(n, b, k, epochs, total) == expect


def _client(switch, protocol="paper", steps=6, seed=0, m=96, n=64, r=4):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(m, n, generator=g) * 0.1)
    x, y = torch.randn(48, n, generator=g), torch.randn(48, m, generator=g)
    aligned = protocol == "aligned"
    opt = GaLoreAdamW([{"params": [("w", w)], "rank": r, "update_proj_gap": 50, "projector": "rsvd_then_random",
                        "moment_transfer": "squared" if aligned else "linear", "bias_correction": "weight" if aligned else "steps",
                        "seeded_from_step": switch}], lr=1e-2)
    opt.set_projection_seed(123)
    client_protocol.mark(opt)
    for _ in range(steps):
        ((x @ w.T - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return opt, w


@pytest.mark.parametrize("protocol", ["paper", "aligned"])
def test_the_round_ends_on_R_k_and_the_upload_is_not_moved(protocol):
    opt, w = _client(3, protocol)
    st = opt.state[w]
    r_k = client_protocol.view_seed(opt, "w")
    assert r_k == basis_seed(123, "w", 0) and st.basis_seed == r_k
    terms = client_protocol.export_update(opt)["w"].terms
    assert isinstance(terms[0], LowRank) and isinstance(terms[1], SeededLowRank) and terms[1].seed == r_k
    raw, evidence = st.exp_avg_sq.clone(), moment_exchange.v_weight(st, st.side, opt.param_groups[0]["betas"][1]).clone()
    view = client_protocol.export_moments(opt, {"w": r_k}, buffer=protocol == "paper")["w"]
    if protocol == "paper":
        assert torch.equal(view.moment, raw) and view.weight is None  # Algorithm 1 line 10: the raw buffer, exactly
    else:
        torch.testing.assert_close(view.moment * view.weight[None, :], raw, rtol=1e-6, atol=1e-12)
    d = client_protocol.moment_diagnostics(opt)["w"]
    assert d["upload_kept"] == 1.0 and d["view_step_share"] == pytest.approx(3 / 6)


def test_the_step_schedule_never_reaches_R_k_and_its_upload_is_moved():
    """The defect as measured: τ = 50 over 6 steps, every step on the client's RSVD basis; moving
    the buffer onto the unrelated R_k keeps a small share of it (the review: 6.8 % at 96×64, r 4)."""
    opt, w = _client(-1)
    client_protocol.export_moments(opt, {"w": client_protocol.view_seed(opt, "w")}, buffer=True)
    d = client_protocol.moment_diagnostics(opt)["w"]
    assert d["view_step_share"] == 0.0 and d["upload_kept"] < 0.5


def test_no_refresh_after_the_switch_and_r_k_from_step_zero():
    opt, w = _client(0, steps=4)
    st = opt.state[w]
    assert st.refresh == 1 and st.basis_seed == client_protocol.view_seed(opt, "w")  # one basis, R_k, the whole round
    assert client_protocol.moment_diagnostics(opt)["w"]["view_step_share"] == 1.0


@pytest.mark.parametrize("group,match", [
    ({"projector": "rsvd", "seeded_from_step": 2}, "no such phase"),
    ({"projector": "rsvd_then_random", "seeded_from_step": 2, "adaptive_scope": "global"}, "per-round schedule"),
    ({"projector": "rsvd_then_random", "seeded_from_step": -3}, "seeded_from_step"),
    ({"projector": "rsvd_then_random", "low_precision": "half"}, "low_precision"),
])
def test_bad_schedule_options_are_one_clear_error(group, match):
    w = torch.nn.Parameter(torch.randn(8, 6))
    with pytest.raises(ValueError, match=match):
        GaLoreAdamW([{"params": [w], "rank": 2, **group}])


def test_method_options_of_the_schedule():
    m = get_method("fedgalore", rank=4)
    assert m.options.projector_schedule == "epoch" and m.options.adaptive_epochs == 1.0
    assert get_method("fedgalore", rank=4, projector="rsvd").options.projector_schedule == "steps"  # one phase
    with pytest.raises(MethodError, match="projector_schedule: steps"):
        get_method("fedgalore", rank=4, adaptive_scope="global")
    with pytest.raises(MethodError, match="adaptive_epochs"):
        get_method("fedgalore", rank=4, adaptive_epochs=-1)
    with pytest.raises(MethodError, match="adaptive_share"):
        get_method("fedgalore", rank=4, projector_schedule="share", adaptive_share=1.5)


def _diags(res):
    return [json.loads(line) for line in (res.run_dir / "diagnostics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("protocol", ["paper", "aligned"])
def test_a_federation_trains_on_R_k_and_syncs_unmoved_uploads(tmp_path, protocol):
    """Two local epochs (the offline budget's E): about half of every round's steps on R_k (the
    issue asks ≥ 40 %), every upload kept whole, the synchronised state on R_k's seed; the share of
    v̄ the next round's warm start keeps is reported (across the change of round seed)."""
    res = fedgalore.run(tiny_cfg(tmp_path, "fedgalore", rounds=3, method_options={"moment_protocol": protocol},
                                 train={"lr": 1e-2, "batch_size": 8, "local_epochs": 2, "weight_decay": 0.01}))
    diag = _diags(res)
    assert all(d["view_step_share"] >= 0.4 and d["upload_kept"] == 1.0 for d in diag)
    assert all(0.0 <= d["warm_kept"] <= 1.0 for d in diag[1:])
    clients = [json.loads(line) for line in (res.run_dir / "clients.jsonl").read_text().splitlines()]
    assert all(c["upload_kept"] == 1.0 for c in clients if "error" not in c)


def test_fedgalore_minus_reports_its_schedule_too(tmp_path):
    res = fedgalore.run(tiny_cfg(tmp_path, "fedgalore_minus", rounds=2,
                                 train={"lr": 1e-2, "batch_size": 8, "local_epochs": 2, "weight_decay": 0.01}))
    assert all(d["view_step_share"] >= 0.4 for d in _diags(res))


def test_paper_modes_literal_reprojection_at_the_switch_inflates_steps(tmp_path):
    """What the epoch schedule exposes in Algorithm 1 as written: at the switch RSVD → R_k, App. B's
    buffer reprojection ṽ ← ṽC (then our clamp at 0) leaves many coordinates of the second moment
    at 0 while the first moment moves with them, so the next steps are much larger than a cold
    start's. Already in round 1 (no warm start yet) paper mode's client updates are more than twice
    FedGaLore⁻'s; with the sign-invariant ``squared`` move they are FedGaLore⁻'s."""
    over = {"train": {"lr": 1e-2, "batch_size": 8, "local_epochs": 2, "weight_decay": 0.01}}
    norms = {}
    for label, method, opts in (("paper", "fedgalore", {"moment_protocol": "paper"}),
                                ("paper_squared", "fedgalore", {"moment_protocol": "paper", "moment_transfer": "squared"}),
                                ("minus", "fedgalore_minus", {})):
        norms[label] = _diags(fedgalore.run(tiny_cfg(tmp_path / label, method, rounds=1, method_options=opts, **over)))[0][
            "client_update_norm_mean"]
    assert norms["paper"] > 2 * norms["minus"]
    assert norms["paper_squared"] == pytest.approx(norms["minus"], rel=1e-5)
