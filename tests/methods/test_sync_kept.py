"""FedGaLore's ``first_basis: synced`` (NOT the paper's Algorithm 1, which refreshes data-driven bases
first — App. E "SVD-to-random projectors"; ours, for the feature-skew study): from the second round a
client that holds the synchronised state v̄ runs the epoch schedule's data-driven phase on v̄'s view
basis B instead of RSVD refreshes, so its warm start keeps v̄ whole; round 1 and the switch to R_k are
unchanged. Tiny ``tiny_text`` runs, E = 2 local epochs (module doc of fedgalore.methods.fedgalore)."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fedgalore
import fedgalore.optim.functional as F
from fedgalore.job.resolve import method_options
from fedgalore.methods.base import MethodError, get_method
from fedgalore.methods.fedgalore import FedGaLore
from fedgalore.optim import GaLoreAdamW, client_protocol
from fedgalore.optim.projector import resolve_side
from fedgalore.protocol.bases import basis_seed
from fedgalore.protocol.payload import GaLoreUpdate, LowRank, MomentView, SeededLowRank

from fedgalore_testing.runs import tiny_cfg


TWO_EPOCHS = {"lr": 1e-2, "batch_size": 16, "local_epochs": 2, "weight_decay": 0.01}


def _spied_run(tmp_path, monkeypatch, rounds=3, **options):
    """A tiny FedGaLore run recording, per (round, client), the synchronised views the client
    received and every basis refresh of its optimizer (matrix, local step, basis, seed, held),
    and per round the uploads A received."""
    seen: dict = {"views": {}, "refreshes": {}, "uploads": {}, "round_seed": {}}
    current: list = [None]
    client_update, aggregate, refresh = FedGaLore.client_update, FedGaLore.aggregate, F.refresh

    def spy_client(self, model, broadcast, ctx):
        key = (int(broadcast.meta["round"]), ctx.client)
        current[0] = key
        seen["round_seed"][key[0]] = int(broadcast.meta["round_seed"])
        seen["views"][key] = {n: broadcast.entries[f"moment/{n}"] for n in self.targets if f"moment/{n}" in broadcast.entries}
        seen["refreshes"][key] = []
        return client_update(self, model, broadcast, ctx)

    def spy_refresh(p, name, group, state, g32):
        refresh(p, name, group, state, g32)
        seen["refreshes"][current[0]].append((name, state.step, state.basis.detach().clone(), state.basis_seed, state.held))

    def spy_aggregate(self, state, uploads, weights, ctx):
        seen["uploads"][ctx.round] = (list(uploads), {n: state.params[n].clone() for n in self.targets}, list(ctx.clients))
        return aggregate(self, state, uploads, weights, ctx)

    monkeypatch.setattr(FedGaLore, "client_update", spy_client)
    monkeypatch.setattr(FedGaLore, "aggregate", spy_aggregate)
    monkeypatch.setattr(F, "refresh", spy_refresh)
    res = fedgalore.run(tiny_cfg(tmp_path, "fedgalore", rounds=rounds, method_options=options, train=TWO_EPOCHS))
    clients = [json.loads(line) for line in (res.run_dir / "clients.jsonl").read_text().splitlines()]
    assert all(c.get("error") is None for c in clients), [c.get("error") for c in clients]
    return res, clients, seen


def test_synced_first_basis_keeps_the_state_and_leaves_round_one_alone(tmp_path, monkeypatch):
    """Aligned protocol (default): with ``first_basis: synced`` every client of rounds 2 and 3
    keeps its whole prior (prior_retained > 0.999); the default keeps far less on the same run.
    Round 1 (no state) uploads the same records and views with and without the option."""
    _, default, d_seen = _spied_run(tmp_path / "default", monkeypatch)
    _, synced, s_seen = _spied_run(tmp_path / "synced", monkeypatch, first_basis="synced")
    for recs in (default, synced):
        assert {r["round"] for r in recs} == {1, 2, 3} and all("prior_retained" not in r for r in recs if r["round"] == 1)
    later_s = [r["prior_retained"] for r in synced if r["round"] >= 2]
    later_d = [r["prior_retained"] for r in default if r["round"] >= 2]
    assert len(later_s) == 6 and min(later_s) > 0.999, later_s
    assert len(later_d) == 6 and max(later_d) < 0.5, later_d  # measured ~0.11 at rank 4
    # round 1: same clients, same uploads (records as dense deltas, second-moment views)
    (ups_d, w0, cl_d), (ups_s, _, cl_s) = d_seen["uploads"][0], s_seen["uploads"][0]
    assert cl_d == cl_s and len(ups_d) == len(ups_s) == 3
    for a, b in zip(ups_d, ups_s):
        for n in w0:
            torch.testing.assert_close(a[n].materialize(w0[n]), b[n].materialize(w0[n]), rtol=1e-5, atol=1e-7)
            va, vb = a[f"moment/{n}"], b[f"moment/{n}"]
            assert va.seed == vb.seed and va.basis is None and vb.basis is None
            torch.testing.assert_close(va.moment, vb.moment, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(va.weight, vb.weight, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("protocol", [{"moment_protocol": "paper"},  # view basis: the seeded R_k
                                      {"moment_protocol": "aligned", "view_basis": "consensus"},
                                      {"moment_protocol": "aligned", "projector_schedule": "share"}])
def test_the_data_driven_phase_runs_on_the_broadcast_view_basis(tmp_path, monkeypatch, protocol):
    """In rounds 2-3 each matrix's first basis is the basis of the v̄ it received (to fp32
    rounding), held unrefreshed (update_proj_gap = 1 would refresh every step) until one switch
    to R_k; the record's first term is on that basis (its seed, which the server accepts) and the
    last on R_k. Round 1: RSVD refreshes as without the option. (Under the epoch schedule every
    client ends on R_k, so the consensus protocol's views share R_k and B is R_{k-1} too.)"""
    _, clients, seen = _spied_run(tmp_path, monkeypatch, first_basis="synced", update_proj_gap=1, **protocol)
    paper = protocol["moment_protocol"] == "paper"
    for r in clients:
        if r["round"] >= 2:
            assert r["warm_kept"] > (0.99 if paper else 0.999)  # paper: v̄'s negative entries are clamped, as always
            if not paper:
                assert r["prior_retained"] > 0.999
    checked = 0
    for (k, client), log in seen["refreshes"].items():
        names = sorted({name for name, *_ in log})
        for n in names:
            mine = [(step, basis, seed, held) for name, step, basis, seed, held in log if name == n]
            r_k = basis_seed(seen["round_seed"][k], n, 0)
            assert mine[-1][2] == r_k  # every client ends the round on R_k
            if k == 0:
                assert not any(h for *_, h in mine) and mine[0][2] == -1  # RSVD first, refreshed every step
                assert len(mine) == mine[-1][0] + 1
                continue
            view = seen["views"][(k, client)][n]
            assert isinstance(view, MomentView) and view.basis is None and view.seed != r_k
            (step0, basis0, seed0, held0), (step1, _, seed1, held1) = mine[0], mine[1]
            assert len(mine) == 2 and step0 == 0 and step1 > 1 and held0 and not held1
            assert seed0 == view.seed and seed1 == r_k
            torch.testing.assert_close(basis0.cpu(), view.basis_matrix(), rtol=0, atol=1e-6)
            checked += 1
    assert checked >= 6 * 3  # two rounds x three clients, every adapted matrix
    for k in (1, 2):
        ups, _, _ = seen["uploads"][k]
        assert len(ups) == 3  # none rejected
        view_seeds = {n: seen["views"][(k, c)][n].seed for c in seen["uploads"][k][2] for n in seen["views"][(k, c)]}
        for up in ups:
            for n, seed in view_seeds.items():
                terms = up[n].terms
                assert isinstance(terms[0], SeededLowRank) and terms[0].seed == seed  # v̄'s basis travels as its seed
                assert isinstance(terms[-1], SeededLowRank) and terms[-1].seed == basis_seed(seen["round_seed"][k], n, 0)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_a_matrix_view_basis_is_held_too(shape):
    """Optimizer level (group key ``hold_warm_basis``): a warm start on an explicit basis B (a
    consensus basis) puts the data-driven phase on B — no refresh before the switch, the warm
    start exact — and the record's term for it is B with its coefficients; without a warm start
    the group refreshes RSVD bases as it would without the key."""
    torch.manual_seed(0)
    m, n = shape
    side = resolve_side(shape, "std")
    r = 4
    q = torch.linalg.qr(torch.randn(n if side == "right" else m, r, dtype=torch.float64))[0].float()
    b = q.T.contiguous() if side == "right" else q.contiguous()
    view = MomentView(torch.rand((m, r) if side == "right" else (r, n)) + 0.1, side, shape, b, None, torch.rand(r) + 0.5)

    def run(warm: bool):
        w = nn.Parameter(torch.randn(m, n))
        w0 = w.detach().clone()
        opt = GaLoreAdamW([{"params": [("w", w)], "rank": r, "projector": "rsvd_then_random", "update_proj_gap": 1,
                            "seeded_from_step": 3, "bias_correction": "weight", "moment_transfer": "squared",
                            "hold_warm_basis": True}], lr=1e-2, projection_seed=7)
        if warm:
            client_protocol.load_second_moment(opt, "w", view)
        client_protocol.mark(opt)
        bases = []
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            w.grad = torch.randn(m, n, generator=gen)
            opt.step()
            bases.append(client_protocol.export_state(opt)["w"])
        return opt, bases, client_protocol.export_update(opt)["w"], w.detach() - w0, w0

    opt, bases, rec, delta, w0 = run(True)
    for e in bases[:3]:
        torch.testing.assert_close(e.basis, b, rtol=0, atol=0)
        assert e.seed is None
    assert bases[3].seed == client_protocol.view_seed(opt, "w") and bases[4].seed == bases[3].seed
    assert client_protocol.moment_diagnostics(opt)["w"]["prior_retained"] > 0.999
    assert isinstance(rec, GaLoreUpdate) and len(rec.terms) == 2 and isinstance(rec.terms[0], LowRank)
    held_basis = rec.terms[0].right if side == "right" else rec.terms[0].left
    torch.testing.assert_close(held_basis, b, rtol=0, atol=0)
    torch.testing.assert_close(rec.materialize(w0), delta, rtol=1e-4, atol=1e-6)
    _, cold, _, _, _ = run(False)  # no warm start: RSVD refreshed at every step of the phase
    assert all(e.seed is None for e in cold[:3]) and not torch.allclose(cold[0].basis, cold[1].basis)
    assert not torch.allclose(cold[0].basis, b, atol=1e-2)


def test_group_key_needs_the_epoch_schedule():
    w = nn.Parameter(torch.randn(8, 12))
    with pytest.raises(ValueError, match="hold_warm_basis.*seeded_from_step"):
        GaLoreAdamW([{"params": [("w", w)], "rank": 2, "projector": "rsvd_then_random", "hold_warm_basis": True}])


@pytest.mark.parametrize("options, match", [
    ({"sync": "none"}, "without a sync"),
    ({"projector": "rsvd"}, "does not have"),
    ({"projector": "random"}, "does not have"),
    ({"projector_schedule": "steps"}, "projector_schedule='steps'"),
    ({"adaptive_epochs": 0}, "leaves empty"),
    ({"projector_schedule": "share", "adaptive_share": 0.0}, "leaves empty"),
])
def test_combinations_without_a_data_driven_phase_or_a_state_are_refused_in_one_line(options, match):
    with pytest.raises(MethodError, match=match) as info:
        get_method("fedgalore", rank=4, first_basis="synced", **options)
    assert "\n" not in str(info.value) and "first_basis='synced'" in str(info.value)


def test_the_option_comes_from_the_config_and_the_ablation_without_sync_refuses_it(tmp_path):
    cfg = tiny_cfg(tmp_path, "fedgalore", rounds=1, method_options={"first_basis": "synced"})
    assert method_options(cfg).first_basis == "synced"
    assert method_options(tiny_cfg(tmp_path, "fedgalore", rounds=1)).first_basis == "adaptive"  # the default
    for ok in ({"projector_schedule": "share"}, {"sync": "aggregate"}, {"sync": "mean", "moment_protocol": "paper"}):
        assert get_method("fedgalore", rank=4, first_basis="synced", **ok).options.first_basis == "synced"
    with pytest.raises(MethodError, match="without a sync") as info:
        method_options(tiny_cfg(tmp_path, "fedgalore_minus", rounds=1, method_options={"first_basis": "synced"}))
    assert "\n" not in str(info.value)


def test_fedgalore_methods_lists_the_option(capsys):
    from fedgalore.cli import main

    assert main(["methods"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("first_basis"))
    assert "adaptive" in line and "synced" in line and "NOT the paper" in line
