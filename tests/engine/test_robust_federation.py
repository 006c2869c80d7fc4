"""Robust aggregation against a hostile site (issue 42): ``federation.robust`` in the round loop,
measured with ``federation.attack`` (a simulated site that scales or sign-flips its upload).

The rules themselves are checked against Flower's FedMedian / FedTrimmedAvg / Krum on the same
inputs in tests/federated/test_robust.py; here: what each method gives the rules (its factored updates equal
its dense ones in every inner product), what a run records, what is refused, and the accuracy a
hostile ×50 site costs with and without a defence (tiny_text, 6 sites, Dirichlet 0.5, 8 rounds; the
numbers in the asserts were measured on seed 0 and the margins are the documented ones).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fedgalore
from fedgalore.job.config import ConfigError
from fedgalore.federated import robust
from fedgalore.jsonl import read_jsonl
from fedgalore_testing.runs import tiny_cfg  # noqa: E402

FED = {"num_clients": 6, "clients_per_round": 6, "rounds": 8, "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}}


def run(tmp_path: Path, name: str, method: str = "fedavg_full", lr: float = 1e-2, rounds: int = 8, **fed):
    cfg = tiny_cfg(tmp_path / name, method, federation={**FED, "rounds": rounds, **fed},
                   train={"lr": lr, "batch_size": 16, "local_epochs": 3, "weight_decay": 0.01})
    return fedgalore.run(cfg)


def acc(res) -> float:
    return float(res.summary["final"]["accuracy"])


ATTACK = {"clients": [0], "kind": "scale"}  # ×50


# ----------------------------------------------------------------------------- accuracy under attack
def test_a_scaled_site_ruins_fedavg_and_every_defence_holds_accuracy(tmp_path):
    clean = acc(run(tmp_path, "clean"))
    attacked = acc(run(tmp_path, "attacked", attack=ATTACK))
    assert clean > 0.8 and attacked < clean - 0.4  # the ×50 site ruins plain FedAvg
    for kind, margin in (("norm_filter", 0.05), ("median", 0.05), ("trimmed_mean", 0.05)):
        res = run(tmp_path, kind, attack=ATTACK, robust={"kind": kind})
        assert acc(res) >= clean - margin, (kind, acc(res), clean)
    # Multi-Krum keeping 4 of 6 drops an honest site every round too (non-IID data lost): a wider margin
    res = run(tmp_path, "krum", attack=ATTACK, robust={"kind": "krum", "num_malicious": 1, "to_keep": 4})
    assert acc(res) >= clean - 0.25, acc(res)
    recs = read_jsonl(res.run_dir / "clients.jsonl")
    hostile = [r for r in recs if r["client"] == 0]
    assert len(hostile) == 8 and all("Krum keeps" in r["robust_excluded"] for r in hostile)
    diag = read_jsonl(res.run_dir / "diagnostics.jsonl")
    assert all(d["robust_kept"] == 4 and d["robust_excluded"] == 2 for d in diag)
    from fedgalore.report import build_report

    rep = build_report(res.run_dir, tmp_path / "report", plots=False)
    assert "client 0 in 8 of 8 rounds" in (tmp_path / "report" / "excluded.md").read_text()
    assert rep["comparison"]["robust_excluded"][res.run_dir.name]["0"] == 8


def test_a_scaled_lora_site_is_filtered_by_its_factored_norm(tmp_path):
    """FedIT (factors uploaded): ×50 on each factor's change; the norm filter compares ΔW_i through
    the factors and drops it every round; the run stays within 0.15 of clean (the filtered site's own
    non-IID data is lost with it)."""
    clean = acc(run(tmp_path, "clean", "fedit", lr=0.05))
    attacked = acc(run(tmp_path, "attacked", "fedit", lr=0.05, attack=ATTACK))
    res = run(tmp_path, "norm", "fedit", lr=0.05, attack=ATTACK, robust={"kind": "norm_filter"})
    assert attacked < clean - 0.3 and acc(res) >= clean - 0.15, (clean, attacked, acc(res))
    recs = [r for r in read_jsonl(res.run_dir / "clients.jsonl") if "robust_excluded" in r]
    assert {r["client"] for r in recs} == {0} and len(recs) == 8


# ----------------------------------------------------------------------------- what the rules see
@pytest.mark.parametrize("method, options", [
    ("fedavg_full", {}), ("fedit", {}), ("ffa_lora", {}), ("flora", {}), ("fr_lora", {}), ("lora_fair", {}),
    ("fedgalore", {}), ("fedgalore", {"projector": "random"}),
])
def test_factored_updates_have_the_dense_updates_inner_products(tmp_path, monkeypatch, method, options):
    """Every method's :meth:`update_terms` (factors, never m×n where they suffice) has the Gram matrix
    of its dense :meth:`client_deltas`, on real uploads of a round (rtol 1e-5: fp32 uploads)."""
    import fedgalore.engine.stages.robust as stage

    seen = []
    real = stage.apply_robust

    def spy(cfg, m, state, uploads):
        g = robust.gram([m.update_terms(state, u) for u in uploads])
        dense = [m.client_deltas(state, u) for u in uploads]
        ref = torch.tensor([[sum(float((a[k].double() * b[k].double()).sum()) for k in a) for b in dense] for a in dense], dtype=torch.float64)
        seen.append((g, ref))
        return real(cfg, m, state, uploads)

    monkeypatch.setattr(stage, "apply_robust", spy)
    cfg = tiny_cfg(tmp_path, method, rounds=2, method_options=options,
                   federation={**FED, "rounds": 2, "robust": {"kind": "krum", "num_malicious": 1, "to_keep": 3}})
    fedgalore.run(cfg)
    assert len(seen) == 2
    for g, ref in seen:
        assert torch.allclose(g, ref, rtol=1e-5, atol=1e-9 * float(ref.abs().max()))
        assert float(ref.abs().max()) > 0


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("method, fed, words", [
    ("fedit", {"robust": {"kind": "median"}}, "use kind krum or norm_filter"),
    ("fedgalore", {"robust": {"kind": "trimmed_mean"}}, "coordinate-wise statistic of dense uploads"),
    ("fedavg_full", {"clients_per_round": 3, "robust": {"kind": "krum", "num_malicious": 1}}, "needs at least 4 clients per round"),
    ("fedavg_full", {"robust": {"kind": "mean"}}, "federation.robust.kind='mean' must be one of"),
    ("fedavg_full", {"robust": {"kind": "trimmed_mean", "beta": 0.5}}, "beta=0.5 must be in"),
    ("fedavg_full", {"attack": {"clients": [9]}}, "names a client outside 0..5"),
])
def test_bad_robust_settings_are_one_line(tmp_path, method, fed, words):
    with pytest.raises(ConfigError) as e:
        tiny_cfg(tmp_path, method, federation={**FED, **fed})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_robust_with_client_dp_and_attack_in_a_deployment_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="sensitivity is no longer privacy.client.clip"):
        tiny_cfg(tmp_path, federation={**FED, "robust": {"kind": "norm_filter"}},
                 privacy={"client": {"clip": 0.5, "noise_multiplier": 1.0}})
    with pytest.raises(ConfigError, match="a Flower deployment's sites are real ones"):
        tiny_cfg(tmp_path, federation={**FED, "attack": ATTACK}, backend={"name": "flower"})
