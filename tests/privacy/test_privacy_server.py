"""Privacy that holds against the server (docs/privacy.md, "Threat model"):

* every DP draw — record-level Poisson sampling, DP-SGD's noise, client-level noise (central and
  distributed) — comes from OS entropy: two runs of one config draw differently, and an adversary
  holding the config (the server) cannot regenerate the noise; ``privacy.reproducible: true``
  brings the seeded draws back for studies, says so, and a deployment refuses it;
* nothing raw reaches the server's view under ``privacy.client``: a raw-norm rule and a GaLore
  weight-decay term are refused, uploads carry no counts, ``privacy.json``'s field list covers
  every field a real upload carries, the server's records hold no client time, size or error text;
* the cap holds at every release: dropouts plus retries under distributed noise, record-level
  ``target_epsilon`` under the expected-rounds calibration, a round re-run after a crash.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("opacus")
pytest.importorskip("dp_accounting")

import fedgalore  # noqa: E402
from fedgalore.engine.backends.sequential import SequentialBackend  # noqa: E402
from fedgalore.engine.stages.client_dp import ClientRelease  # noqa: E402
from fedgalore.job.config import ConfigError, FederatedConfig  # noqa: E402
from fedgalore.privacy.view import CLIENT_FAILED  # noqa: E402
from fedgalore.engine.loop import Federation  # noqa: E402
from fedgalore.engine.stages.record_dp import SitePrivacy  # noqa: E402
from fedgalore.job.resolve import method_options  # noqa: E402
from fedgalore.federated.seeding import DP_CLIENT_NOISE, client_seed  # noqa: E402
from fedgalore.federated.client import ClientError  # noqa: E402
from fedgalore.methods.base import method_class, register  # noqa: E402
from fedgalore.methods.fedavg_full import FedAvgFull  # noqa: E402
from fedgalore.privacy.randomness import REPRODUCIBLE_REFUSED  # noqa: E402
from fedgalore.protocol.payload import Dense, Payload  # noqa: E402
from fedgalore_testing.runs import _Kill, cdp_cfg, tiny_cfg  # noqa: E402


def _release(cfg: FederatedConfig, method: str = "fedavg_full") -> ClientRelease:
    return ClientRelease(cfg, cfg.privacy.client, method_class(method)(4, method_options(cfg)), 6)


def _zero_upload(n: int = 20000) -> Payload:
    """An upload whose change from the broadcast is zero: what it releases is the noise alone."""
    return Payload({"w": Dense(torch.zeros(n))}, {"client": 1, "round": 0})


# ----------------------------------------------------------------------------- randomness
@pytest.mark.parametrize("reproducible", [False, True])
def test_two_runs_of_one_seed_draw_different_samples_and_noise(tmp_path, reproducible):
    """Default: two processes of one config (same seed, round, client) draw different Poisson
    samples, DP-SGD noise seeds and client-level noise (central and distributed). Reproducible:
    identical draws (the studies' mode)."""
    rec_cfg = tiny_cfg(tmp_path, "fedavg_full", privacy={"record": {"noise_multiplier": 1.0}, "reproducible": reproducible})
    draws = []
    for _ in range(2):
        sp = SitePrivacy(rec_cfg, rec_cfg.privacy.record, sizes=[200], steps=[6], support={})
        gen, _ = sp.batches(np.arange(200), 0, 3, lambda idx: idx)
        dp = sp.client(0, 3)
        cen = _release(cdp_cfg(tmp_path, reproducible=reproducible)).server_side([_zero_upload()] * 3, None, 3)
        dis = _release(cdp_cfg(tmp_path, noise="distributed", reproducible=reproducible)).client_side(_zero_upload(), None, 3, 1)
        draws.append((list(gen()), dp.noise_seed, dp.secure_mode, cen[0]["w"].tensor, dis["w"].tensor))
    (b1, s1, secure1, c1, d1), (b2, s2, _, c2, d2) = draws
    same = (b1 == b2, s1 == s2, torch.equal(c1, c2), torch.equal(d1, d2))
    assert same == ((True,) * 4 if reproducible else (False,) * 4)
    assert secure1 is (not reproducible)  # Opacus' secure Gaussian sampling unless reproducible
    assert float(d1.std()) == pytest.approx(1.0 * 0.5 / math.sqrt(3), rel=0.05)  # the same distribution either way


@pytest.mark.parametrize("reproducible", [False, True])
def test_a_regenerating_adversary_cannot_remove_the_noise(tmp_path, reproducible):
    """The server holds the config: it regenerates the seeded stream of client 1's distributed
    noise and subtracts it. Reproducible: it removes the noise exactly (the mode says so);
    default: the residual is as large as the noise."""
    cfg = cdp_cfg(tmp_path, noise="distributed", reproducible=reproducible)
    released = _release(cfg).client_side(_zero_upload(), None, 3, 1)["w"].tensor
    seq = client_seed(cfg.seed, 3, 1, DP_CLIENT_NOISE)
    g = torch.Generator().manual_seed(int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1)))
    std = 1.0 * 0.5 / math.sqrt(3)
    guess = torch.randn(released.shape, generator=g) * std
    residual = float((released - guess).std())
    if reproducible:
        assert residual < 1e-6
        doc = _run_doc(cdp_cfg(tmp_path / "run", reproducible=True))
        assert doc["reproducible"] is True and any("holds the config" in x for x in doc["not_protected"])
        assert "NOT protected" in doc["statement"]
    else:
        assert residual > 0.9 * std


def _run_doc(cfg: FederatedConfig, **kw) -> dict:
    res = fedgalore.run(cfg, **kw)
    return json.loads((res.run_dir / "privacy.json").read_text())


def test_a_deployment_refuses_reproducible_noise(tmp_path):
    class Deployed(SequentialBackend):
        simulated = False

    with pytest.raises(ConfigError) as exc:
        Federation(cdp_cfg(tmp_path, reproducible=True), backend=Deployed())
    assert str(exc.value) == REPRODUCIBLE_REFUSED and "\n" not in REPRODUCIBLE_REFUSED


def test_secure_mode_key_is_gone_with_one_line(tmp_path):
    d = {"name": "t", "task": {"name": "tiny_text"}, "federation": {"num_clients": 2},
         "privacy": {"record": {"noise_multiplier": 1.0, "secure_mode": True}}}
    with pytest.raises(ConfigError) as exc:
        FederatedConfig.from_dict(d)
    msg = str(exc.value)
    assert "\n" not in msg and "privacy.record.secure_mode was removed" in msg and "privacy.reproducible" in msg


# ----------------------------------------------------------------------------- nothing raw
@pytest.mark.parametrize("over, key", [({"federation": {"max_update_norm": 1.0}}, "federation.max_update_norm"),
                                       ({"method": "fedgalore", "weight_decay": 0.01}, "train.weight_decay")])
def test_rules_that_read_raw_uploads_are_refused(tmp_path, over, key):
    method = over.get("method", "fedavg_full")
    cfg = cdp_cfg(tmp_path, method, federation=over.get("federation"))
    if "weight_decay" in over:
        cfg.train.weight_decay = over["weight_decay"]
    with pytest.raises(ConfigError) as exc:
        fedgalore.run(cfg)
    assert "\n" not in str(exc.value) and key in str(exc.value)


class _Spy(SequentialBackend):
    """The sequential backend, keeping every upload as it left its client."""

    def __init__(self):
        super().__init__()
        self.uploads: list[Payload] = []

    def run_clients(self, broadcast, jobs, progress=None):
        out = super().run_clients(broadcast, jobs, progress)
        self.uploads += [r.upload for r in out if isinstance(r.upload, Payload)]
        return out


@pytest.mark.parametrize("noise", ["central", "distributed"])
def test_privacy_json_lists_every_field_a_real_upload_carries(tmp_path, noise):
    spy = _Spy()
    cfg = cdp_cfg(tmp_path, rounds=2, noise=noise, adaptive_clipping={"target_quantile": 0.5})
    res = Federation(cfg, backend=spy).run()
    doc = json.loads((res.run_dir / "privacy.json").read_text())
    declared = {name.strip() for k in doc["upload_fields"] if k.startswith("meta:")
                for name in k.removeprefix("meta:").split(",")}
    carried = {k for u in spy.uploads for k in u.meta}
    assert spy.uploads and carried <= declared, carried - declared
    assert not carried & {"num_examples", "steps", "loss_mean", "loss_first", "loss_last"}
    assert ("dp_clip_bit" in carried) is (noise == "distributed")  # central: the server draws the bits' noise
    recs = [json.loads(x) for x in (res.run_dir / "clients.jsonl").read_text().splitlines()]
    assert recs and not any({"time", "num_examples"} & set(r) for r in recs)  # the server records no size or time


# ----------------------------------------------------------------------------- the cap
@register
class _FlakyFedAvg(FedAvgFull):
    """FedAvg-Full whose clients 0 and 1 fail every round (dropouts that force retries)."""

    name = "test_flaky_fedavg_dp"

    def client_update(self, model, broadcast, ctx):
        if ctx.client in (0, 1):
            raise ClientError(f"client {ctx.client}: flaky site, rows 3 and 7 unreadable")
        return super().client_update(model, broadcast, ctx)


def test_budget_holds_under_dropouts_and_retries(tmp_path):
    """Distributed noise without secure aggregation, clients 0 and 1 always failing, min_clients 3
    (retries): every attempt's releases count and the cap holds at every one — the run stops before
    the release that would pass target_epsilon, and the headline is one upload as the server sees it."""
    probe = _release(cdp_cfg(tmp_path / "probe", noise="distributed"))
    from fedgalore.privacy.client_dp import client_epsilon

    per = probe.upload_multiplier()
    target = 0.5 * (client_epsilon([(per, 1, 2)], 1, 1e-5) + client_epsilon([(per, 1, 3)], 1, 1e-5))  # 2 uploads fit
    cfg = cdp_cfg(tmp_path / "run", "test_flaky_fedavg_dp", rounds=6, noise="distributed", target_epsilon=target,
                  federation={"min_clients": 3, "max_round_retries": 4})
    res = fedgalore.run(cfg)
    doc = json.loads((res.run_dir / "privacy.json").read_text())
    client = doc["client"]
    assert "privacy budget" in res.summary["stopped"]
    assert client["epsilon"] <= target and max(client["uploads_seen"].values()) == 2
    assert client["epsilon"] > client["epsilon_sum"]  # the server's view of one upload, not the sum's
    recs = [json.loads(x) for x in (res.run_dir / "clients.jsonl").read_text().splitlines()]
    errors = {r.get("error") for r in recs if r.get("client") in (0, 1)}
    assert errors == {CLIENT_FAILED}  # no row numbers


def test_record_level_target_is_a_cap(tmp_path):
    """calibration: expected plans σ for a site's expected rounds; a site sampled more often is
    held back before it passes target_epsilon. The default calibration is every_round."""
    from fedgalore.privacy.config import RecordPrivacy

    assert RecordPrivacy().calibration == "every_round"
    cfg = tiny_cfg(tmp_path, "fedavg_full", rounds=6,
                   privacy={"record": {"target_epsilon": 4.0, "calibration": "expected"}})
    res = fedgalore.run(cfg)
    doc = json.loads((res.run_dir / "privacy.json").read_text())
    eps = [s["epsilon"] for s in doc["sites"].values()]
    assert eps and max(eps) <= 4.0 * (1 + 1e-9)
    assert doc.get("stopped_sites")  # some site was sampled more often than expected, and stopped
    recs = [json.loads(x) for x in (res.run_dir / "clients.jsonl").read_text().splitlines()]
    assert any("privacy budget spent" in (r.get("error") or "") for r in recs)


def test_a_round_rerun_after_a_crash_is_accounted(tmp_path):
    """OS-entropy noise: round 2 released, the process killed before its checkpoint, the resumed run
    re-runs round 2 with fresh noise — both releases count (privacy_journal.jsonl)."""
    cfg = cdp_cfg(tmp_path, rounds=3, output={"checkpoint_every": 1})
    with pytest.raises(KeyboardInterrupt):
        fedgalore.run(cfg, progress=_Kill(at_round=1))
    run_dir = next(Path(cfg.output.dir).iterdir())
    resumed = fedgalore.resume(run_dir)
    doc = json.loads((resumed.run_dir / "privacy.json").read_text())
    assert [r["round"] for r in doc["recovered_releases"]] == [2]
    assert sum(h[2] for h in doc["client"]["history"]) == 4  # rounds 1, 2 (lost), 2 (re-run), 3
    from fedgalore.privacy.client_dp import client_epsilon

    rel = _release(cfg)
    assert doc["client"]["epsilon"] == pytest.approx(client_epsilon([(rel.round_multiplier(3), 3, 4)], 6, 1e-5), rel=1e-9)


@pytest.mark.parametrize("level", ["client", "record"])
def test_a_crash_before_the_first_checkpoint_keeps_its_releases(tmp_path, level):
    """Round 1 released, the process killed before checkpoint 1: the resumed run restarts at round 0,
    and the journal's round-1 releases still count (a re-run draws fresh noise)."""
    cfg = (cdp_cfg(tmp_path, rounds=2, output={"checkpoint_every": 1}) if level == "client" else
           tiny_cfg(tmp_path, "fedavg_full", rounds=2, privacy={"record": {"noise_multiplier": 1.0}}))
    with pytest.raises(KeyboardInterrupt):
        fedgalore.run(cfg, progress=_Kill(at_round=0))
    run_dir = next(Path(cfg.output.dir).iterdir())
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    journal = [json.loads(x) for x in (run_dir / "privacy_journal.jsonl").read_text().splitlines()]
    resumed = fedgalore.resume(run_dir)
    doc = json.loads((resumed.run_dir / "privacy.json").read_text())
    assert len(doc["recovered_releases"]) == len(journal) > 0
    assert {r["round"] for r in doc["recovered_releases"]} == {1}
    if level == "client":
        assert sum(h[2] for h in doc["client"]["history"]) == 3  # round 1 (lost), rounds 1 and 2 (re-run)
        from fedgalore.privacy.client_dp import client_epsilon

        rel = _release(cfg)
        assert doc["client"]["epsilon"] == pytest.approx(client_epsilon([(rel.round_multiplier(3), 3, 3)], 6, 1e-5), rel=1e-9)
    else:
        lost = {str(e["client"]): e["entry"][2] for e in journal}
        for c, site in doc["sites"].items():  # every lost client-round's steps are in its site's history
            ran = sum(r["sites"][c]["steps"] for r in doc["rounds"] if c in r["sites"])
            assert site["steps"] == ran + lost.get(c, 0)


def test_the_budget_counts_releases_lost_before_the_first_checkpoint(tmp_path):
    """target_epsilon fits two rounds; round 1 released, killed before its checkpoint: the resumed
    run re-runs round 1 and stops there — ε never passes the target."""
    from fedgalore.privacy.client_dp import client_epsilon

    probe = _release(cdp_cfg(tmp_path / "probe"))
    s = probe.round_multiplier(3)
    target = 0.5 * (client_epsilon([(s, 3, 2)], 6, 1e-5) + client_epsilon([(s, 3, 3)], 6, 1e-5))
    cfg = cdp_cfg(tmp_path / "run", rounds=4, target_epsilon=target, output={"checkpoint_every": 1})
    with pytest.raises(KeyboardInterrupt):
        fedgalore.run(cfg, progress=_Kill(at_round=0))
    resumed = fedgalore.resume(next(Path(cfg.output.dir).iterdir()))
    doc = json.loads((resumed.run_dir / "privacy.json").read_text())
    assert "privacy budget" in resumed.summary["stopped"] and resumed.summary["rounds_completed"] == 1
    assert sum(h[2] for h in doc["client"]["history"]) == 2
    assert doc["client"]["epsilon"] <= target


def test_a_round_adapter_is_written_after_its_release_is_journaled(tmp_path, monkeypatch):
    """Account before release: with export.every_round under central noise, the process killed right
    after round 1's adapter is written — the journal already holds round 1's release, and the
    resumed run accounts it."""
    import fedgalore.engine.loop as loop

    cfg = cdp_cfg(tmp_path, "fedit", rounds=2)
    cfg.export.every_round = True
    seen = []

    def adapter_then_kill(runtime, state, run_dir, round):  # noqa: A002
        out = loop_save(runtime, state, run_dir, round)
        journal = Path(run_dir) / "privacy_journal.jsonl"
        seen.append([json.loads(x) for x in journal.read_text().splitlines()] if journal.exists() else [])
        raise KeyboardInterrupt("killed after the adapter")

    loop_save = loop.save_round_adapter
    monkeypatch.setattr(loop, "save_round_adapter", adapter_then_kill)
    with pytest.raises(KeyboardInterrupt):
        fedgalore.run(cfg)
    run_dir = next(Path(cfg.output.dir).iterdir())
    assert (run_dir / "adapters" / "round-0001").is_dir()
    assert [(e["level"], e["round"]) for e in seen[0]] == [("client", 1)]  # journaled before the adapter existed
    monkeypatch.setattr(loop, "save_round_adapter", loop_save)
    doc = json.loads((fedgalore.resume(run_dir).run_dir / "privacy.json").read_text())
    assert [r["round"] for r in doc["recovered_releases"]] == [1]
    assert sum(h[2] for h in doc["client"]["history"]) == 3


@pytest.mark.parametrize("level", ["client", "record"])
def test_the_report_says_a_reproducible_run_is_not_protected_against_the_config(tmp_path, capsys, level):
    """privacy.reproducible: the report's privacy line (as the model card's) says whom it does not protect against."""
    from fedgalore.cli import main

    cfg = (cdp_cfg(tmp_path, rounds=1, reproducible=True) if level == "client" else
           tiny_cfg(tmp_path, "fedavg_full", rounds=1, privacy={"record": {"noise_multiplier": 1.0}, "reproducible": True}))
    res = fedgalore.run(cfg)
    capsys.readouterr()
    assert main(["report", str(res.run_dir), "--no-plots"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Privacy"))
    assert "NOT protected against whoever holds the config (privacy.reproducible)" in line, line


@pytest.mark.parametrize("level", ["client", "record"])
def test_noise_zero_is_clipping_only_and_not_protected(tmp_path, capsys, level):
    """σ = 0 clips and adds no noise (ε = ∞): privacy.json, the report and the model card say it is
    not protected — never "protected at (ε, δ)"."""
    from fedgalore.cli import main

    cfg = (cdp_cfg(tmp_path, "fedit", rounds=1, noise_multiplier=0.0) if level == "client" else
           tiny_cfg(tmp_path, "fedit", rounds=1, privacy={"record": {"noise_multiplier": 0.0}}))
    res = fedgalore.run(cfg)
    doc = json.loads((res.run_dir / "privacy.json").read_text())
    assert doc["protected"] is False
    assert "clipping only" in doc["statement"] and "NOT protected: ε = ∞" in doc["statement"]
    assert "protected at" not in doc["statement"]
    assert any("adds no noise (ε = ∞)" in x for x in doc["not_protected"])
    capsys.readouterr()
    assert main(["report", str(res.run_dir), "--no-plots"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Privacy"))
    assert line == "Privacy (every method): NOT protected — clipping only (σ = 0: no noise, ε = ∞).", line
    assert main(["export", str(res.run_dir), "--out", str(tmp_path / "exp")]) == 0
    card = (tmp_path / "exp" / "README.md").read_text()
    assert "| privacy | NOT protected — clipping only (σ = 0: no noise, ε = ∞) |" in card
