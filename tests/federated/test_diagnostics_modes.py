"""The diagnostics' two modes (fedgalore.federated.diagnostics).

* Default: a FedGaLore round's updates reach the diagnostics in factors (``ΔW = a·W + L R``), and no
  ``m × n`` update is formed for them: the tail energy from ``QᵀΔW`` with ``Q = orth(L)`` (exact without
  weight decay; with it, above the full SVD's by at most its returned bound, within 1e-3 here), the
  drift from the factors' Gram matrices (the dense formula's numbers to 1e-5).
* ``diagnostics_exact: true``: the dense deltas and full SVDs, the computation before, bit for bit.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import fedgalore
import fedgalore.engine.loop as loop_mod
import fedgalore.federated.diagnostics as diag_mod
from fedgalore.federated.diagnostics import (FactoredDelta, drift_diagnostics, drift_factored, tail_energy,
                                             tail_energy_factored, update_space_diagnostics)
from fedgalore.job.config import FederatedConfig

TINY = {"n_train": 96, "n_test": 24, "hidden_size": 24, "num_layers": 1, "seq_len": 8}


def _factored(m: int, n: int, s: int, scale: float, seed: int, base: torch.Tensor | None = None) -> FactoredDelta:
    g = torch.Generator().manual_seed(seed)
    left = torch.randn(m, s, generator=g) * torch.logspace(0, -2, s)  # a falling spectrum, as GaLore terms have
    right = torch.randn(s, n, generator=g) / math.sqrt(n)
    w = base if base is not None else torch.randn(m, n, generator=g) * 0.05
    return FactoredDelta(left, right, scale, w if scale else None)


def _old_drift(client_deltas, weights):
    """The dense drift formula as it was before the factored mode (a verbatim copy of its arithmetic)."""
    names = list(client_deltas[0])
    mean = {n: sum(float(w) * d[n].float() for d, w in zip(client_deltas, weights)) for n in names}
    den = math.sqrt(sum(float(m.square().sum(dtype=torch.float64)) for m in mean.values()))
    drifts = [math.sqrt(sum(float((d[n].float() - mean[n]).square().sum(dtype=torch.float64)) for n in names)) / den for d in client_deltas]
    norms = [math.sqrt(sum(float(d[n].float().square().sum(dtype=torch.float64)) for n in names)) for d in client_deltas]
    return {"drift_mean": sum(drifts) / len(drifts), "drift_max": max(drifts),
            "client_update_norm_mean": sum(norms) / len(norms), "aggregate_update_norm": den}


@pytest.mark.parametrize("shape", [(300, 200), (200, 300)])
def test_the_factored_tail_energy_is_exact_without_decay_and_within_its_bound_with_it(shape):
    m, n = shape
    plain = _factored(m, n, 24, 0.0, 0)
    est, bound = tail_energy_factored(plain, 8)
    assert bound == 0.0 and est == pytest.approx(tail_energy(plain.dense(), 8), abs=1e-5)
    # decay a = -lr·wd·steps with the shipped lr and weight decay: ‖aW‖ a few % of ‖LR‖
    for scale in (-2e-3, -2e-2):
        d = _factored(m, n, 24, scale, 1)
        exact = tail_energy(d.dense(), 8)
        est, bound = tail_energy_factored(d, 8)
        assert 0.0 < bound < 2e-3
        assert est * est - bound - 1e-6 <= exact * exact <= est * est + 1e-6  # the stated error, both sides
        assert est == pytest.approx(exact, abs=1e-3)


def test_the_factored_drift_gives_the_dense_formulas_numbers():
    w = {"a": torch.randn(120, 80) * 0.05, "b": torch.randn(64, 96) * 0.05}
    clients = [{k: _factored(*v.shape, 6 + i, -1e-3 * (i + 1), 10 * i + j, base=v) for j, (k, v) in enumerate(w.items())}
               for i in range(3)]
    weights = [0.5, 0.3, 0.2]
    got = drift_factored(clients, weights)
    want = _old_drift([{k: v.dense() for k, v in c.items()} for c in clients], weights)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5)
    assert drift_diagnostics(clients, weights) == got  # the entry point takes the factored path


def test_dense_inputs_keep_the_old_formulas_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    deltas = [{"a": torch.randn(40, 30, generator=g), "b": torch.randn(20, 50, generator=g)} for _ in range(3)]
    assert drift_diagnostics(deltas, [0.2, 0.3, 0.5]) == _old_drift(deltas, [0.2, 0.3, 0.5])
    big = {"w": torch.randn(600, 500, generator=g)}
    assert update_space_diagnostics(big, 8, exact=True)["tail_energy_mean"] == tail_energy(big["w"], 8)


def _cfg(out: Path, **over) -> FederatedConfig:
    d = {"name": "diag", "seed": 0, "task": {"name": "tiny_text", "options": dict(TINY)},
         "method": {"name": "fedgalore", "rank": 2},
         "federation": {"num_clients": 3, "clients_per_round": 3, "rounds": 2, "partition": {"kind": "iid"}},
         "train": {"lr": 2e-2, "batch_size": 8, "local_steps": 2, "weight_decay": 0.01},  # the shipped pipelines' decay
         "output": {"dir": str(out), "progress": "quiet"}}
    d.update(over)
    return FederatedConfig.from_dict(d)


def _run(cfg: FederatedConfig, monkeypatch) -> tuple[list[dict], list[str]]:
    """The run's diagnostics records, and the kinds of update the loop handed the diagnostics."""
    seen: list[str] = []
    space, drift = diag_mod.update_space_diagnostics, diag_mod.drift_diagnostics

    def spy_space(applied, rank, exact=False):
        seen.extend(type(v).__name__ for v in applied.values())
        return space(applied, rank, exact=exact)

    def spy_drift(deltas, weights):
        seen.extend(type(v).__name__ for d in deltas for v in d.values())
        return drift(deltas, weights)

    monkeypatch.setattr(loop_mod, "update_space_diagnostics", spy_space)
    monkeypatch.setattr(loop_mod, "drift_diagnostics", spy_drift)
    res = fedgalore.run(cfg)
    recs = [json.loads(line) for line in (Path(res.run_dir) / "diagnostics.jsonl").read_text().splitlines()]
    return recs, seen


def test_a_fedgalore_run_computes_its_diagnostics_from_factors_close_to_the_exact_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(diag_mod, "EXACT_MAX_FLOPS", 0.0)  # the tiny matrices take the large-matrix path too
    fast, kinds_fast = _run(_cfg(tmp_path / "fast"), monkeypatch)
    exact, kinds_exact = _run(_cfg(tmp_path / "exact", diagnostics_exact=True), monkeypatch)
    assert set(kinds_fast) == {"FactoredDelta"} and set(kinds_exact) == {"Tensor"}
    assert len(fast) == len(exact) == 2
    for f, e in zip(fast, exact):
        for k in ("tail_energy_mean", "tail_energy_max"):
            assert f[k] >= e[k] - 1e-6 and f[k] == pytest.approx(e[k], abs=1e-3)
        for k in ("drift_mean", "drift_max", "client_update_norm_mean", "aggregate_update_norm"):
            assert f[k] == pytest.approx(e[k], rel=1e-4)
        same = lambda r: {k: v for k, v in r.items() if not any(w in k for w in ("tail", "drift", "norm", "time"))}  # noqa: E731
        assert same(f) == same(e)  # the sync's numbers do not depend on the mode


def test_the_exact_mode_hands_the_diagnostics_the_old_dense_updates(tmp_path, monkeypatch):
    """``diagnostics_exact: true``: the drift reads each client's ``ΔW_i = materialize(W_k)`` and the
    tail energy the aggregate's dense ``ΔW`` — the inputs of before — through the unchanged dense formulas."""
    from fedgalore.engine.collect import Collector

    got = []
    orig = Collector.collect

    def spy(self, att, results, summed, state, rctx, keys):
        orig(self, att, results, summed, state, rctx, keys)
        for item in att.kept:
            want = {n: item.upload[n].materialize(state.params[n]) for n in item.delta}
            got.append(all(torch.equal(item.delta[n], want[n]) for n in want))

    monkeypatch.setattr(Collector, "collect", spy)
    recs, kinds = _run(_cfg(tmp_path, diagnostics_exact=True), monkeypatch)
    assert got and all(got) and set(kinds) == {"Tensor"}
    assert all(math.isfinite(r["tail_energy_mean"]) and math.isfinite(r["drift_mean"]) for r in recs)
