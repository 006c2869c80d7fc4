"""Client-level DP's noise against the signal it hides (fedgalore.privacy.signal; docs/privacy.md,
"Noise against the signal"): the formula's numbers, the real mechanism's noise norm against it,
d as the method counts it against a real upload, and the line a run says before round 1."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("dp_accounting")

import fedgalore  # noqa: E402
from fedgalore.engine.events import ProgressSink  # noqa: E402
from fedgalore.engine.loop import Federation  # noqa: E402
from fedgalore.privacy.client_dp import is_moment, slots  # noqa: E402
from fedgalore.privacy.signal import noise_vs_signal  # noqa: E402
from fedgalore_testing.runs import cdp_cfg  # noqa: E402


def test_the_formula():
    """Mean: std σC/K, norm σC√d/K, ρ = σ√d/K, K ≥ σ√d; individual: σC/√K, σC√(d/K), K ≥ σ²d."""
    s = noise_vs_signal(1.5, 0.2, 10_000, 4)
    assert s.noise_std == pytest.approx(1.5 * 0.2 / 4) and s.noise_norm == pytest.approx(1.5 * 0.2 * 100 / 4)
    assert s.ratio == pytest.approx(1.5 * 100 / 4) and s.clients_needed == 150 and s.hopeless
    assert "K ≥ σ·√d = 150 clients per round" in s.line() and s.line().startswith("WARNING")
    i = noise_vs_signal(1.5, 0.2, 10_000, 4, mean=False)
    assert i.noise_std == pytest.approx(1.5 * 0.2 / 2) and i.ratio == pytest.approx(1.5 * 100 / 2)
    assert i.clients_needed == 22_500
    ok = noise_vs_signal(1.0, 0.5, 100, 10)  # ρ = 1 · 10 / 10: noise norm ≤ C from K = 10
    assert ok.ratio == pytest.approx(1.0) and not ok.hopeless and ok.clients_needed == 10
    assert "WARNING" not in ok.line() and "noise norm ≤ C holds from K ≥ σ·√d = 10" in ok.line()


class _Said(ProgressSink):
    def __init__(self):
        self.events = []

    def message(self, text):
        self.events.append(("message", text))

    def round_start(self, round, clients):
        self.events.append(("round", round))


@pytest.mark.parametrize("method", ["fedavg_full", "fedit", "fedgalore", "flora"])
def test_d_is_what_an_upload_carries_and_the_run_says_it_before_round_1(tmp_path, method):
    """d (Method.released_coordinates) equals the coordinates of a real upload's change (second
    moments excluded) — FedGaLore's coefficient blocks, not its m·n matrices — and the line with
    those numbers is said before round 1 starts."""
    said = _Said()
    fed = Federation(cdp_cfg(tmp_path, method, rounds=1), progress=said)
    seen, observe = [], fed.stages.observe

    def count(att, results, state):
        seen.extend(sum(t.numel() for (k, _), t in slots(r.upload).items() if not is_moment(k))
                    for r in results if r.upload is not None)
        return observe(att, results, state)

    fed.stages.observe = count
    rt = fed.runtime
    d = rt.method.released_coordinates(rt.model, 1)
    fed.run()
    assert seen and set(seen) == {d}
    if method == "fedgalore":
        assert d < sum(p.numel() for p in rt.model.parameters() if p.requires_grad)
    lines = [i for i, (kind, text) in enumerate(said.events) if kind == "message" and "noise vs signal" in text]
    first_round = next(i for i, (kind, _) in enumerate(said.events) if kind == "round")
    assert len(lines) == 1 and lines[0] < first_round
    rel = fed.stages.get("client_dp").mechanism
    expected = noise_vs_signal(rel.sigma_update, 0.5, d, 3, method != "flora")
    assert expected.line() == said.events[lines[0]][1]


def test_the_noise_in_a_real_round_has_the_predicted_norm(tmp_path):
    """Clients that barely move (lr 1e-12): the applied mean is the central noise z/K alone, and its norm
    is σ·C·√d/K (d = 15,492 coordinates: within 3 %)."""
    cfg = cdp_cfg(tmp_path, "fedavg_full", rounds=1, noise_multiplier=2.0)
    cfg.train.lr = 1e-12  # (must be positive) the clients barely move: the mean is the noise
    fed = Federation(cfg)
    w0 = {k: v.clone() for k, v in fed.state.params.items()}
    rt = fed.runtime
    signal = fed.stages.get("client_dp").mechanism.noise_vs_signal(rt.method.released_coordinates(rt.model, 1))
    fed.run()
    moved = math.sqrt(sum(float((fed.state.params[k] - w0[k]).double().pow(2).sum()) for k in w0))
    assert signal.dim == sum(v.numel() for v in w0.values())
    assert moved == pytest.approx(signal.noise_norm, rel=0.03)
    assert signal.noise_norm == pytest.approx(2.0 * 0.5 * math.sqrt(signal.dim) / 3)
