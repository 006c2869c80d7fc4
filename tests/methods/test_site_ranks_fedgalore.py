"""Sites at different ranks (``federation.site_ranks``) under FedGaLore: nested seeded bases, update
records that add up exactly, second-moment views pooled over the sites that hold each coordinate,
and the config's refusals (docs/design.md, "A rank per site")."""
from __future__ import annotations

import json

import pytest
import torch

import fedgalore
from fedgalore.federated.site_ranks import SiteRanksConfig, site_devices, site_ranks
from fedgalore.methods.fedgalore import FedGaLore
from fedgalore.protocol import second_moment as sm
from fedgalore.protocol.bases import seeded_basis
from fedgalore.protocol.downlink import weighted_update
from fedgalore.protocol.payload import GaLoreUpdate, LowRank, MomentView, Payload, SeededLowRank, decode, encode
from fedgalore.sync.moments import nested_views
from fedgalore.typed import ConfigError
from fedgalore_testing.runs import tiny_cfg

RANKS = (2, 4, 8, 16)


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_lower_rank_basis_is_the_leading_block_of_the_frame(side):
    frame = seeded_basis(99, 24, 40, 16, side)
    for r in (1, 2, 4, 8, 16):
        p = seeded_basis(99, 24, 40, r, side, frame=16)
        lead = frame[:r] if side == "right" else frame[:, :r]
        assert torch.equal(p, lead)
    # without a frame a rank is its own draw (uniform-rank runs keep their bits), which is NOT nested
    assert not torch.allclose(seeded_basis(99, 24, 40, 4, side), frame[:4] if side == "right" else frame[:, :4])
    with pytest.raises(ValueError, match="frame"):
        seeded_basis(99, 24, 40, 8, side, frame=4)


def _record(rank: int, side: str, seed: int, frame: int, gen: torch.Generator, decay: float = 0.0) -> GaLoreUpdate:
    m, n = 24, 40
    coef = torch.randn((m, rank) if side == "right" else (rank, n), generator=gen)
    own = torch.randn(m, rank, generator=gen), torch.randn(rank, n, generator=gen)  # a data-driven term too
    return GaLoreUpdate(decay, (LowRank(*own), SeededLowRank(coef, seed, side, (m, n), None if rank == frame else frame)), (m, n))


@pytest.mark.parametrize("side", ["right", "left"])
def test_records_at_ranks_2_4_8_16_sum_exactly(side):
    """A of one round at four ranks: the factored aggregate equals Σ p_i ΔW_i of the dense deltas,
    and the seeded blocks merge into one term at the largest rank (not Σ r_i)."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(24, 40, generator=gen)
    ups = [_record(r, side, 7, 16, gen, decay=-1e-3 * (i + 1)) for i, r in enumerate(RANKS)]
    p = [0.1, 0.2, 0.3, 0.4]
    dense = sum(pi * u.materialize(w0) for pi, u in zip(p, ups))
    agg = weighted_update(ups, p)
    torch.testing.assert_close(agg.materialize(w0), dense, rtol=1e-5, atol=1e-5)
    seeded = [t for t in agg.terms if isinstance(t, SeededLowRank)]
    assert len(seeded) == 1 and seeded[0].rank == 16 and seeded[0].frame is None
    # three sites without the rank-16 one: the merged block is rank 8 on the rank-16 frame
    part = weighted_update(ups[:3], p[:3])
    (t,) = [t for t in part.terms if isinstance(t, SeededLowRank)]
    assert t.rank == 8 and t.frame == 16
    torch.testing.assert_close(part.materialize(w0), sum(pi * u.materialize(w0) for pi, u in zip(p[:3], ups[:3])),
                               rtol=1e-5, atol=1e-5)


def test_the_frame_travels_and_uniform_payloads_are_unchanged():
    gen = torch.Generator().manual_seed(1)
    mixed = Payload({"w": _record(4, "right", 3, 16, gen), "v": MomentView(torch.rand(24, 4), "right", (24, 40), None, 3, None, 16)}, {})
    back = decode(encode(mixed))
    assert back["w"].terms[1].frame == 16 and back["v"].frame == 16
    torch.testing.assert_close(back["w"].materialize(), mixed["w"].materialize())
    torch.testing.assert_close(back["v"].materialize(), mixed["v"].materialize())
    uniform = Payload({"w": _record(16, "right", 3, 16, gen)}, {})
    assert b'"frame"' not in encode(uniform)  # one rank everywhere: the wire format has no frame


@pytest.mark.parametrize("side", ["right", "left"])
def test_views_of_different_ranks_pool_over_the_sites_that_hold_each_coordinate(side):
    gen = torch.Generator().manual_seed(2)
    ranks, p = (2, 4, 8), [0.5, 0.3, 0.2]

    def mom(r):
        return torch.rand((24, r) if side == "right" else (r, 40), generator=gen) + 0.1

    def cols(x, j):
        return x[:, j] if side == "right" else x[j]

    # with evidence (aligned protocol): the pooled estimate of coordinate j is over its holders only
    views = [MomentView(mom(r), side, (24, 40), None, 5, torch.rand(r, generator=gen) + 0.5, None if r == 8 else 8) for r in ranks]
    padded = nested_views(views, p)
    assert {v.rank for v in padded} == {8}
    pooled, _ = sm.pool([v.moment if side == "right" else v.moment.T for v in padded],
                        [sm.as_evidence(v.weight, side, v.rank, v.moment) if side == "right" else
                         sm.as_evidence(v.weight, side, v.rank, v.moment).T for v in padded], p)
    for j in range(8):
        holders = [(pi, v) for pi, v in zip(p, views) if v.rank > j]
        num = sum(pi * float(v.weight[j]) * cols(v.moment, j) for pi, v in holders)
        den = sum(pi * float(v.weight[j]) for pi, v in holders)
        torch.testing.assert_close(pooled[:, j], num / den, rtol=1e-5, atol=1e-6)
    # without (paper mode): the weighted mean over all sites equals the holders' mean
    views = [MomentView(mom(r), side, (24, 40), None, 5, None, None if r == 8 else 8) for r in ranks]
    padded = nested_views(views, p)
    mean = sum(pi * v.moment for pi, v in zip(p, padded))
    for j in range(8):
        holders = [(pi, v) for pi, v in zip(p, views) if v.rank > j]
        want = sum(pi * cols(v.moment, j) for pi, v in holders) / sum(pi for pi, _ in holders)
        torch.testing.assert_close(cols(mean, j), want, rtol=1e-5, atol=1e-6)
    # the padded views still describe each site's own moment on its own coordinates
    for v, w in zip(views, padded):
        lead = w.moment[:, : v.rank] if side == "right" else w.moment[: v.rank]
        assert torch.equal(lead, v.moment)


def test_tiers_and_single_sites():
    cfg = SiteRanksConfig(tiers=[{"rank": 2, "device_gb": 8}, {"rank": 8}, {"rank": 32, "device_gb": 80}], ranks={"4": 16})
    assert site_ranks(cfg, 9, 8) == [2, 2, 2, 8, 16, 8, 32, 32, 32]
    assert site_devices(cfg, 9) == [8.0, 8.0, 8.0, None, None, None, 80.0, 80.0, 80.0]
    shares = SiteRanksConfig(tiers=[{"rank": 2, "share": 0.5}, {"rank": 8}, {"rank": 32}])
    assert site_ranks(shares, 8, 8) == [2, 2, 2, 2, 8, 8, 32, 32]
    assert site_ranks(SiteRanksConfig(ranks={0: 4}), 3, 8) == [4, 8, 8]
    assert site_ranks(None, 3, 8) is None
    with pytest.raises(ConfigError, match="holds no site"):
        site_ranks(SiteRanksConfig(tiers=[{"rank": 2}, {"rank": 4}, {"rank": 8}]), 2, 8)
    with pytest.raises(ConfigError, match="does not exist"):
        site_ranks(SiteRanksConfig(ranks={5: 4}), 3, 8)
    with pytest.raises(ConfigError, match="sum to 1"):
        SiteRanksConfig(tiers=[{"rank": 2, "share": 0.5}, {"rank": 8, "share": 0.3}])
    with pytest.raises(ConfigError, match="unknown config key"):
        SiteRanksConfig(tiers=[{"rank": 2, "memory": 8}])


def _site_cfg(tmp_path, method="fedgalore", per_round=4, rounds=1, **over):
    fed = {"num_clients": 4, "clients_per_round": per_round, "rounds": rounds,
           "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5},
           "site_ranks": {"ranks": {i: r for i, r in enumerate(RANKS)}}}
    return tiny_cfg(tmp_path, method, rounds=rounds, federation=fed, **over)


@pytest.mark.parametrize("options", [{}, {"projector": "random", "moment_protocol": "paper", "sync": "mean"}])
def test_a_round_at_ranks_2_4_8_16_applies_the_sum_of_the_dense_deltas(tmp_path, monkeypatch, options):
    """A real round (the default epoch schedule: RSVD bases, then the round's seeded R_k; and paper
    mode on seeded bases): every site trains at its own rank, the server's W moves by exactly
    Σ p_i ΔW_i of the clients' dense deltas, and the synchronised state is on the rank-16 frame."""
    seen = {}
    aggregate = FedGaLore.aggregate

    def spy(self, state, uploads, weights, ctx):
        seen["before"] = {n: state.params[n].clone() for n in self.targets}
        seen["dense"] = [self.client_deltas(state, u) for u in uploads]
        seen["uploads"], seen["weights"], seen["clients"] = list(uploads), list(weights), list(ctx.clients)
        out = aggregate(self, state, uploads, weights, ctx)
        seen["after"] = {n: state.params[n].clone() for n in self.targets}
        seen["moments"] = state.moments
        return out

    monkeypatch.setattr(FedGaLore, "aggregate", spy)
    sync = FedGaLore.synchronize

    def keep(self, state, uploads, weights, ctx):
        out = sync(self, state, uploads, weights, ctx)
        seen["moments"] = dict(state.moments)
        return out

    monkeypatch.setattr(FedGaLore, "synchronize", keep)
    fedgalore.run(_site_cfg(tmp_path, method_options=options))
    assert sorted(seen["clients"]) == [0, 1, 2, 3]
    for client, up in zip(seen["clients"], seen["uploads"]):
        for n, entry in up.entries.items():
            if isinstance(entry, GaLoreUpdate):
                ranks = {t.rank if isinstance(t, SeededLowRank) else t.left.shape[1] for t in entry.terms}
                assert ranks == {RANKS[client]}, (client, n, ranks)
                assert all(t.frame == (None if RANKS[client] == 16 else 16) for t in entry.terms if isinstance(t, SeededLowRank))
    for n in seen["before"]:
        want = sum(p * d[n] for p, d in zip(seen["weights"], seen["dense"]))
        torch.testing.assert_close(seen["after"][n] - seen["before"][n], want, rtol=1e-4, atol=1e-6)
    views = [v for v in seen["moments"].values() if isinstance(v, MomentView)]
    assert views and all(v.rank == 16 and v.frame is None for v in views if v.basis is None)


def test_a_site_at_a_lower_rank_warm_starts_from_the_leading_block(tmp_path):
    """Rounds at mixed ranks run through the synchronised state: in round 2 every client, at its
    own rank, loads the round-1 state (rank 16, on the frame) and keeps a share of its evidence."""
    res = fedgalore.run(_site_cfg(tmp_path, per_round=4, rounds=2))
    recs = [json.loads(line) for line in (res.run_dir / "clients.jsonl").read_text().splitlines()]
    first, second = [r for r in recs if r["round"] == 1], [r for r in recs if r["round"] == 2]
    assert len(second) == 4 and all("prior_retained" not in r for r in first)
    assert all(0 < r["prior_retained"] <= 1 and r["warm_kept"] > 0 for r in second)


_PUBLIC = {"projector": "random", "view_basis": "seeded", "sync": "aggregate"}


@pytest.mark.parametrize("method,over,match", [
    ("fedit", {}, "site_ranks: method 'fedit' trains one shape"),
    ("fedgalore", {"federation.secure_aggregation": {}, "backend": {"name": "flower", "options": {}}, "method_options": _PUBLIC},
     "site_ranks with federation.secure_aggregation"),
    ("fedgalore", {"privacy": {"client": {"clip": 1.0, "noise_multiplier": 1.0}}, "method_options": _PUBLIC,
                   "train": {"lr": 1e-2, "batch_size": 16, "local_epochs": 1, "weight_decay": 0.0}},
     "site_ranks with privacy.client"),
])
def test_what_cannot_train_sites_at_different_ranks_is_refused_in_one_line(tmp_path, method, over, match):
    fed = {"num_clients": 4, "clients_per_round": 4, "rounds": 1, "site_ranks": {"tiers": [{"rank": 2}, {"rank": 8}]}}
    extra = {}
    for k, v in over.items():
        if k.startswith("federation."):
            fed[k.split(".", 1)[1]] = v
        else:
            extra[k] = v
    with pytest.raises(ConfigError, match=match) as err:
        tiny_cfg(tmp_path, method, federation=fed, **extra).validate()
    assert "\n" not in str(err.value)
    del fed["site_ranks"]  # the same config without site ranks is accepted
    tiny_cfg(tmp_path, method, federation=fed, **extra).validate()


def test_a_mixed_rank_run_resumes_to_the_same_numbers(tmp_path):
    """The synchronised state and the factored downlink's chain keep their frames through a
    checkpoint: a run killed after round 2 and resumed ends as the uninterrupted one."""
    from fedgalore_testing.runs import killed_and_resumed

    killed_and_resumed(_site_cfg(tmp_path / "full", per_round=2, rounds=4), _site_cfg(tmp_path / "killed", per_round=2, rounds=4),
                       at_round=2)
