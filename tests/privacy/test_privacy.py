"""Record-level differential privacy (issue 41, part 1): DP-SGD at each site through Opacus, the
per-site accountant, privacy.json, the report / model card / plan lines and the bad-input lines.

What is checked, and against what:

* ε per site equals Google's ``dp-accounting`` on the same (σ, q, steps) to 2 % (RDP and PRV/PLD);
* clipping is real: on the training step, an example whose gradient is ×1000 contributes at
  most C, and the privatised gradient equals Σ_i clip_C(g_i) / (q·n) computed independently with
  ``torch.func`` per-example gradients;
* GaLoreAdamW never sees the raw gradient: every gradient its ``step`` and its projector refresh
  read is the privatised one, and a twin optimizer fed the privatised gradients alone reproduces
  its state (projector bases, both moments, the update record) and weights bit for bit;
* every method runs with ``privacy.record`` from YAML alone; privacy.json, report, model card and
  plan state ε, δ and the mechanism; a run without DP says nothing was protected;
* each bad input is one line and exit 2; a killed and resumed run continues the accountant exactly.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("opacus")
pytest.importorskip("dp_accounting")

import fedgalore  # noqa: E402
from fedgalore.optim import client_protocol, functional
from fedgalore.cli import main  # noqa: E402
from fedgalore.job.config import ConfigError, FederatedConfig  # noqa: E402
from fedgalore.federated.client import local_train  # noqa: E402
from fedgalore.optim import GaLoreAdamW  # noqa: E402
from fedgalore.privacy.accounting import calibrate_noise, epsilon, reference_epsilon, site_schedule  # noqa: E402
from fedgalore.privacy.config import RecordPrivacy  # noqa: E402
from fedgalore.privacy.dpsgd import DPSGD, poisson_steps  # noqa: E402
from fedgalore.protocol.state import ClientContext  # noqa: E402
from fedgalore.protocol.train_config import TrainConfig  # noqa: E402
from fedgalore_testing.runs import killed_and_resumed, strip_times, tiny_cfg  # noqa: E402

DP = {"record": {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "delta": 1e-5}}


def dp_cfg(tmp_path: Path, method: str = "fedgalore", rounds: int = 1, method_options: dict | None = None,
           reproducible: bool = False, **record) -> FederatedConfig:
    return tiny_cfg(tmp_path, method, rounds=rounds, method_options=method_options or {},
                    privacy={"record": {**DP["record"], **record}, "reproducible": reproducible})


# ----------------------------------------------------------------------------- accounting
@pytest.mark.parametrize("accountant", ["rdp", "prv"])
@pytest.mark.parametrize("history", [
    [(1.0, 0.55, 2), (1.0, 0.55, 2)],  # a site in two rounds of tiny_text's size
    [(1.1, 16 / 89, 18)],  # offline_text: a site of 89 examples, 18 steps
    [(0.9, 0.05, 400), (1.3, 0.1, 50)],  # two σ / q regimes composed
])
def test_epsilon_equals_dp_accounting(history, accountant):
    ours = epsilon(history, 1e-5, accountant)
    ref = reference_epsilon(history, 1e-5, accountant)
    assert 0.5 < ours < 100
    assert abs(ours - ref) <= 0.02 * ref, (ours, ref)


def test_accounting_edges_and_calibration():
    assert epsilon([], 1e-5) == 0.0 and epsilon([(1.0, 0.5, 0)], 1e-5) == 0.0
    assert epsilon([(0.0, 0.5, 3)], 1e-5) == math.inf  # clipping only
    # composition: two rounds of T steps = one history of 2T steps
    assert epsilon([(1.0, 0.3, 4), (1.0, 0.3, 4)], 1e-5) == pytest.approx(epsilon([(1.0, 0.3, 8)], 1e-5), rel=1e-12)
    sigma = calibrate_noise(3.0, 1e-5, 0.2, 30, "rdp")
    assert 2.99 - 0.011 <= epsilon([(sigma, 0.2, 30)], 1e-5) <= 3.0  # spends the target, to Opacus' tolerance
    rec = RecordPrivacy(target_epsilon=3.0, calibration="expected")
    sch = site_schedule(rec, 80, 16, 1, 5, rounds=12, participation=0.5)  # q = 0.2, 6 planned rounds = 30 steps
    assert (sch.sample_rate, sch.planned_steps, sch.noise_multiplier) == (0.2, 30, sigma)
    every = site_schedule(RecordPrivacy(target_epsilon=3.0, calibration="every_round"), 80, 16, 1, 5, 12, 0.5)
    assert every.planned_steps == 60 and every.noise_multiplier > sigma  # planned for all 12 rounds: more noise
    assert every.epsilon_every_round(RecordPrivacy(target_epsilon=3.0, calibration="every_round")) <= 3.0


def test_poisson_sampling_rate_and_micro_batches():
    draws = poisson_steps(200, 0.1, 300, 2, seed=3)
    assert len(draws) == 600  # steps x micro-batches
    sizes = [len(draws[2 * i]) + len(draws[2 * i + 1]) for i in range(300)]
    assert sum(sizes) / 300 == pytest.approx(20, rel=0.05)  # E|B| = q n
    assert len(set(sizes)) > 5  # Poisson: the batch size varies
    assert all(len(d) == 0 or (d.min() >= 0 and d.max() < 200) for d in draws)
    assert [d.tolist() for d in poisson_steps(200, 0.1, 5, 1, seed=3)] == [d.tolist() for d in poisson_steps(200, 0.1, 5, 1, seed=3)]


# ----------------------------------------------------------------------------- the training step
class _Recorder(torch.optim.SGD):
    """SGD with lr 0 that records the gradient every step reads."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _ctx(batches, n, loss_fn, **train) -> ClientContext:
    tc = TrainConfig(lr=1.0, batch_size=len(batches[0]["x"]), local_steps=len(batches), warmup_ratio=0.0,
                     schedule="constant", grad_clip=None, **train)
    return ClientContext(round=0, total_rounds=1, client=0, round_seed=1, num_examples=n, train=tc, target_modules=[],
                         head_params=[], loss_fn=loss_fn, batches=lambda: iter(batches), steps=len(batches),
                         steps_per_round=len(batches))


def _per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each example's gradient of its own loss, by torch.func (independent of Opacus)."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.mse_loss(functional_call(model, p, (xi[None],)), yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def test_clipping_is_real_on_the_training_step():
    """An example whose gradient is ×1000 moves the privatised gradient by at most C/(q·n), and the
    step's gradient is exactly Σ_i clip_C(g_i) / (q·n) (noise 0, so the clip is what is seen)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    loss_fn = lambda m, b: nn.functional.mse_loss(m(b["x"]), b["y"])  # noqa: E731
    C, n, q = 0.5, 20, 0.4

    def step_grad(y_batch):
        opt = _Recorder(model.parameters())
        ctx = _ctx([{"x": x, "y": y_batch}], n, loss_fn)
        ctx.privacy = DPSGD(noise_multiplier=0.0, max_grad_norm=C, sample_rate=q, num_examples=n, noise_seed=0)
        stats = local_train(model, opt, ctx)
        assert stats["dp_steps"] == 1 and not hasattr(model.weight, "grad_sample")  # hooks and attributes gone
        return torch.cat([g.flatten() for g in opt.seen[0]])

    clean = step_grad(y)
    outlier_y = y.clone()
    outlier_y[3] *= 1000.0  # example 3's gradient ~1000x larger
    outlier = step_grad(outlier_y)
    per = _per_example_grads(model, x, outlier_y)
    flat = torch.cat([per[k].reshape(8, -1) for k in ("weight", "bias")], dim=1)
    assert flat[3].norm() > 100 * C  # the raw gradient of example 3 is huge
    clipped = flat * (C / (flat.norm(dim=1, keepdim=True) + 1e-6)).clamp(max=1.0)
    assert torch.allclose(outlier, clipped.sum(0) / (q * n), atol=1e-6)  # Σ clip(g_i) / (q n)
    assert clipped[3].norm() <= C + 1e-5  # what example 3 contributes before noise
    assert (outlier - clean).norm() * q * n <= 2 * C + 1e-5  # only example 3 changed: the sums differ by ≤ 2C


def test_noise_is_added_with_the_stated_scale():
    """σ C / (q n) per coordinate: the privatised gradient of a zero-gradient model is pure noise."""
    model = nn.Linear(50, 40, bias=False)
    nn.init.zeros_(model.weight)
    x = torch.zeros(4, 50)
    loss_fn = lambda m, b: (m(b["x"]) ** 2).mean()  # noqa: E731
    opt = _Recorder(model.parameters())
    ctx = _ctx([{"x": x}], 10, loss_fn)
    ctx.privacy = DPSGD(noise_multiplier=2.0, max_grad_norm=3.0, sample_rate=0.5, num_examples=10, noise_seed=5)
    local_train(model, opt, ctx)
    g = opt.seen[0][0]
    assert g.std().item() == pytest.approx(2.0 * 3.0 / 5.0, rel=0.05)


def test_empty_poisson_draw_still_steps_with_noise():
    model = nn.Linear(4, 2)
    loss_fn = lambda m, b: nn.functional.mse_loss(m(b["x"]), b["y"])  # noqa: E731
    opt = _Recorder(model.parameters())
    ctx = _ctx([{"x": torch.randn(2, 4), "y": torch.randn(2, 2)}], 10, loss_fn)
    ctx.batches = lambda: iter([{}, {"x": torch.randn(2, 4), "y": torch.randn(2, 2)}])
    ctx.privacy = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.2, num_examples=10, noise_seed=1)
    stats = local_train(model, opt, ctx)
    assert stats["dp_steps"] == 2 and len(opt.seen) == 2 and opt.seen[0][0].abs().sum() > 0  # noise only


def test_galore_sees_only_the_privatised_gradient(monkeypatch):
    """Everything GaLoreAdamW derives from the gradient — the RSVD projector, both moments, the
    update record — comes from the privatised gradient: its step and its projector refresh read
    exactly the gradients DP-SGD produced, never the raw ones, and a twin fed those gradients
    alone (no Opacus) ends with the same state, update record and weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 3))
    twin = nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 3))
    twin.load_state_dict(model.state_dict())

    def make(m):
        mats = [(n, p) for n, p in m.named_parameters() if p.ndim == 2]
        rest = [(n, p) for n, p in m.named_parameters() if p.ndim != 2]
        opt = GaLoreAdamW([{"params": mats, "rank": 3, "update_proj_gap": 2, "scale": 0.25, "proj_type": "std",
                            "projector": "rsvd_then_random", "seeded_from_step": 4}, {"params": rest}], lr=1e-2)
        opt.set_projection_seed(7)
        client_protocol.mark(opt)
        return opt

    opt = make(model)
    seen_step, seen_refresh, privatised, raw = [], [], [], []
    orig_step, orig_refresh = opt.step, functional.refresh

    def step(closure=None):
        seen_step.append([p.grad.clone() for g in opt.param_groups for p in g["params"]])
        return orig_step(closure)

    def refresh(p, name, group, state, g32):
        seen_refresh.append((id(p), g32.clone()))
        return orig_refresh(p, name, group, state, g32)

    opt.step = step
    monkeypatch.setattr(functional, "refresh", refresh)  # the functional step's refresh (fedgalore.optim.functional)
    xs, ys = torch.randn(6, 8, 12), torch.randint(3, (6, 8))
    batches = [{"x": xs[i], "y": ys[i]} for i in range(6)]
    loss_fn = lambda m, b: nn.functional.cross_entropy(m(b["x"]), b["y"])  # noqa: E731
    ctx = _ctx(batches, 40, loss_fn)
    dp = DPSGD(noise_multiplier=0.7, max_grad_norm=0.05, sample_rate=0.2, num_examples=40, noise_seed=11)
    orig_priv = dp.privatise

    def privatise():
        # the raw mean gradient autograd left, then what DP-SGD makes of it
        raw.append([p.grad.clone() for g in opt.param_groups for p in g["params"]])
        orig_priv()
        privatised.append([p.grad.clone() for g in opt.param_groups for p in g["params"]])

    dp.privatise = privatise
    ctx.privacy = dp
    local_train(model, opt, ctx)
    assert len(seen_step) == len(privatised) == 6
    for s, pv, rw in zip(seen_step, privatised, raw):
        assert all(torch.equal(a, b) for a, b in zip(s, pv))  # the step reads the privatised gradient only
        assert all((a - b).norm() > 0.1 * b.norm() for a, b in zip(s, rw))  # ... which is far from the raw one
    params = [p for g in opt.param_groups for p in g["params"]]
    assert seen_refresh  # refreshes happened (steps 0, 2 data-driven; 4 the seeded switch)
    for pid, g32 in seen_refresh:  # the projector's input is some step's privatised gradient of that matrix
        i = next(j for j, p in enumerate(params) if id(p) == pid)
        assert any(torch.equal(g32, pv[i]) for pv in privatised)
    # the twin: the same optimizer fed the privatised gradients, no Opacus, no data
    topt = make(twin)
    tparams = [p for g in topt.param_groups for p in g["params"]]
    for pv in privatised:
        for p, g in zip(tparams, pv):
            p.grad = g.clone()
        topt.step()
        topt.zero_grad(set_to_none=True)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    for p, tp in zip(params, tparams):
        sa, sb = opt.state[p], topt.state[tp]
        for key in ("exp_avg", "exp_avg_sq", "basis"):
            if getattr(sa, key, None) is not None:
                assert torch.equal(getattr(sa, key), getattr(sb, key)), key
    ua, ub = client_protocol.export_update(opt), client_protocol.export_update(topt)
    assert sorted(ua) == sorted(ub)
    for k in ua:
        w0 = torch.ones(ua[k].shape)
        assert ua[k].decay == ub[k].decay and torch.equal(ua[k].materialize(w0), ub[k].materialize(w0))


# ----------------------------------------------------------------------------- runs
def _read(run_dir: Path, name: str):
    return json.loads((run_dir / name).read_text())


def test_privacy_json_of_a_dp_run_and_of_a_run_without(tmp_path):
    res = fedgalore.run(dp_cfg(tmp_path / "dp", "fedgalore", rounds=2))
    doc = _read(res.run_dir, "privacy.json")
    assert doc["protected"] is True and doc["delta"] == 1e-5
    mech = doc["mechanism"]
    assert mech["max_grad_norm"] == 1.0 and mech["noise_multiplier"] == 1.0 and "Poisson" in mech["sampling"]
    assert mech["per_sample_gradients"] == {"opacus": ["Linear"], "torch_func": []}
    assert any("which sites took part" in s for s in doc["not_protected"])
    sizes = {str(i): n for i, n in enumerate(_read(res.run_dir, "partition.json")["sizes"])}
    clients = [json.loads(line) for line in (res.run_dir / "clients.jsonl").read_text().splitlines()]
    assert clients and all("loss_mean" not in c and c["dp_steps"] >= 1 for c in clients)  # raw losses withheld
    for c, site in doc["sites"].items():
        n = site["num_examples"]
        assert n == sizes[c]
        assert site["sample_rate"] == pytest.approx(min(1.0, 16 / n))
        assert site["steps"] == math.ceil(n / 16) * len(site["rounds"])  # T = ⌈E n / b⌉ per round, E = 1
        assert site["epsilon"] == pytest.approx(epsilon(site["history"], 1e-5), rel=1e-9)
        assert site["epsilon"] == pytest.approx(reference_epsilon(site["history"], 1e-5), rel=0.02)
    assert doc["epsilon_max"] == max(s["epsilon"] for s in doc["sites"].values())
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    rel = doc["rounds"][0]["releases"]
    assert list(rel) == ["update", "moment", "basis", "head", "metrics", "counts"]
    assert all(rel[k]["protected"] and rel[k]["sensitivity"] == 1.0 for k in ("update", "moment", "basis", "head"))
    assert rel["counts"]["protected"] is False and rel["metrics"]["protected"] is True
    metrics = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["dp_epsilon"] == pytest.approx(doc["epsilon_max"])
    assert math.isnan(metrics[-1]["train_loss"])  # no raw loss reached the server

    plain = fedgalore.run(tiny_cfg(tmp_path / "plain", "fedit", rounds=1))
    doc = _read(plain.run_dir, "privacy.json")
    assert doc["protected"] is False and doc["statement"].startswith("Nothing was protected")
    assert doc["rounds"][0]["releases"]["update"] == {"protected": False, "clipped": False, "clip": None,
                                                      "sensitivity": None, "noise_multiplier": None}


def test_every_method_runs_with_privacy_record_from_yaml(tmp_path, capsys):
    """One tiny round per method, by YAML and the CLI alone; ε equals dp-accounting's."""
    from fedgalore.methods.base import available_methods, method_class

    yaml = tmp_path / "dp.yaml"
    yaml.write_text(f"""name: dp
task: {{name: tiny_text, options: {{n_train: 96, n_test: 32, hidden_size: 16, num_layers: 1}}}}
method: {{name: fedgalore, rank: 4}}
federation: {{num_clients: 3, clients_per_round: 2, rounds: 1, partition: {{kind: iid}}}}
train: {{lr: 1.0e-2, batch_size: 16, local_epochs: 1}}
output: {{dir: {tmp_path / 'runs'}, progress: quiet}}
privacy:
  record: {{max_grad_norm: 1.0, noise_multiplier: 1.1, delta: 1.0e-5}}
""")
    kinds = {}
    # the package's methods (tests register their own, e.g. test_faults.py's at import)
    for method in [m for m in available_methods() if method_class(m).__module__.startswith("fedgalore.")]:
        assert main(["run", "--config", str(yaml), f"method.name={method}"]) == 0, capsys.readouterr().err
        run_dir = tmp_path / "runs" / f"dp-{method}-iid-s0"
        doc = _read(run_dir, "privacy.json")
        assert doc["protected"] and len(doc["sites"]) == 2
        for site in doc["sites"].values():
            assert site["steps"] == 2 and site["noise_multiplier"] == 1.1
            assert site["epsilon"] == pytest.approx(reference_epsilon([(1.1, 16 / 32, 2)], 1e-5), rel=0.02)
        kinds[method] = list(doc["rounds"][0]["releases"])
    assert "moment" in kinds["fedgalore"] and "moment" not in kinds["fedgalore_minus"]
    assert all(k[0] == "update" and "head" in k for k in kinds.values())
    capsys.readouterr()


def test_report_model_card_and_plan_state_the_privacy(tmp_path, capsys):
    res = fedgalore.run(dp_cfg(tmp_path / "r", "fedit", rounds=1))
    eps = _read(res.run_dir, "privacy.json")["epsilon_max"]
    assert main(["report", str(res.run_dir), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert f"record-level DP-SGD, ε ≤ {eps:.3g} per site at δ = 1e-05" in out
    assert main(["export", str(res.run_dir), "--out", str(tmp_path / "exp")]) == 0
    card = (tmp_path / "exp" / "README.md").read_text()
    assert f"| privacy | record-level DP-SGD at each site (Opacus, Poisson sampling, RDP accountant): ε ≤ {eps:.3g}" in card
    cfg = tmp_path / "plan.yaml"
    cfg.write_text((res.run_dir / "config.yaml").read_text())
    capsys.readouterr()
    assert main(["plan", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "## Privacy (record-level DP-SGD at each site: C = 1, σ = 1; Opacus RDP accountant" in out
    assert "if it takes part in every round: up to" in out
    plain = fedgalore.run(tiny_cfg(tmp_path / "p", "fedit", rounds=1))
    assert main(["report", str(plain.run_dir), "--no-plots"]) == 0
    assert "Privacy (every method): none — nothing was protected." in capsys.readouterr().out


def _record_dp_yaml(tmp_path, method: str, noise_multiplier: float):
    """A tiny record-level DP run's config file (the bad-input tests add one override to it)."""
    yaml = tmp_path / "bad.yaml"
    yaml.write_text(f"""name: bad
task: {{name: tiny_text, options: {{n_train: 96, n_test: 32, hidden_size: 16, num_layers: 1}}}}
method: {{name: {method}, rank: 4}}
federation: {{num_clients: 3, clients_per_round: 2, rounds: 1, partition: {{kind: iid}}}}
output: {{dir: {tmp_path / 'runs'}, progress: quiet}}
privacy: {{record: {{max_grad_norm: 1.0, noise_multiplier: {noise_multiplier}}}}}
""")
    return yaml


@pytest.mark.parametrize("override, message", [
    ("privacy.record.delta=0.1", "privacy.record.delta=0.1 must be below 1/n ="),
    ("privacy.record.max_grad_norm=0", "privacy.record.max_grad_norm=0 must be a positive number"),
    ("privacy.record.max_grad_norm=-1", "privacy.record.max_grad_norm=-1 must be a positive number"),
    ("privacy.record.target_epsilon=2", "privacy.record.noise_multiplier=0 adds no noise, so no target_epsilon=2"),
    ("privacy.record.noise_multiplier=null", "privacy.record needs noise_multiplier"),
    ("privacy.record.accountant=gdp", "privacy.record.accountant='gdp' must be one of 'rdp', 'prv'"),
    ("privacy.record.noise_multiplier=true", "privacy.record.noise_multiplier must be a number, got True"),
    ("privacy.record.max_grad_norm=true", "privacy.record.max_grad_norm must be a number, got True"),
    ("privacy.record.delta=false", "privacy.record.delta must be a number, got False"),
    ("privacy.record.noise_multiplier=1e300", "σ and σ·C must be at most 1e+06"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, override, message):
    yaml = _record_dp_yaml(tmp_path, "fedgalore", 0.0)
    assert main(["run", "--config", str(yaml), override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    runs = tmp_path / "runs"
    assert not runs.exists() or not any((d / "checkpoints").exists() for d in runs.iterdir())  # nothing written


@pytest.mark.parametrize("overrides, message", [
    (["privacy.record.noise_multiplier=null", "privacy.record.target_epsilon=1e-6"],
     "privacy.record.target_epsilon: no noise multiplier reaches ε=1e-06"),  # was a ValueError traceback
    (["privacy.record.noise_multiplier=null", "privacy.record.target_epsilon=true"],
     "privacy.record.target_epsilon must be a number, got True"),
])
def test_a_target_no_noise_meets_is_one_line(tmp_path, capsys, overrides, message):
    from fedgalore_testing.cmdline import _error

    yaml = _record_dp_yaml(tmp_path, "fedavg_full", 1.0)
    assert message in _error(capsys, ["run", "--config", str(yaml), *overrides])
    runs = tmp_path / "runs"
    assert not runs.exists() or not any((d / "summary.json").exists() for d in runs.iterdir())  # nothing ran


def test_a_model_opacus_cannot_make_private_is_refused(tmp_path):
    """A trainable BatchNorm (its batch statistics mix examples): one line naming the layer."""
    from fedgalore.tasks.synthetic import TinyTextTask

    class WithBatchNorm(TinyTextTask):
        def build_model(self):
            model = super().build_model()
            model.classifier = nn.Sequential(nn.BatchNorm1d(model.config.hidden_size), model.classifier)
            return model

    cfg = dp_cfg(tmp_path, "fedavg_full", method_options={"trainable": "all"})
    with pytest.raises(ConfigError) as exc:
        fedgalore.run(cfg, task=WithBatchNorm(n_train=160, n_test=64))
    msg = str(exc.value)
    assert "\n" not in msg and "Opacus cannot compute private per-example gradients" in msg and "classifier.0 is a BatchNorm" in msg


def test_resume_continues_the_accountant(tmp_path):
    """A run killed after checkpoint 2 (inside round 3) and resumed spends exactly what the
    uninterrupted run spends: the same privacy.json, metrics and ε per round."""
    # release_metrics: the losses travel (finite train_loss, so the histories compare equal)
    # reproducible: the re-run of the lost round draws the same noise (the default's fresh draws are a second
    # release, counted: tests/privacy/test_privacy_server.py)
    full, resumed = killed_and_resumed(dp_cfg(tmp_path / "a", "fedgalore", rounds=4, release_metrics=True, reproducible=True),
                                       dp_cfg(tmp_path / "b", "fedgalore", rounds=4, release_metrics=True, reproducible=True))
    a, b = _read(full.run_dir, "privacy.json"), _read(resumed.run_dir, "privacy.json")
    assert a == b and len(a["rounds"]) == 4
    assert a["rounds"][0]["releases"]["metrics"]["protected"] is False  # raw losses in the clear, and said so
    assert any("training losses" in s for s in a["not_protected"])
    assert [h["dp_epsilon"] for h in strip_times(resumed.history)] == [r["epsilon_max"] for r in a["rounds"]]


def test_cached_rdp_is_opacus_rdp_accountant():
    from opacus.accountants import RDPAccountant

    hist = [(1.0, 0.3, 7), (0.8, 0.1, 40), (1.0, 0.3, 3)]
    acc = RDPAccountant()
    acc.history = [tuple(h) for h in hist]
    assert epsilon(hist, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


def test_docs_yaml_is_a_valid_config():
    """docs/privacy.md's and README's YAML, added to the default pipeline, load as written."""
    import re

    from fedgalore.job.config import load_config

    repo = Path(__file__).resolve().parents[2]
    base = (repo / "conf/pipeline/offline_text.yaml").read_text()
    readme = (repo / "README.md").read_text()
    section = readme[readme.index("## Privacy"):readme.index("## Python API")]
    docs = (repo / "docs/privacy.md").read_text()
    blocks = [*re.findall(r"```yaml\n(.*?)```", section, re.S), *re.findall(r"```yaml\n(.*?)```", docs, re.S)]
    blocks = [b for b in blocks if b.startswith("privacy:")]  # a site's own policy file is not a pipeline (test_site_policy)
    assert len(blocks) == 3  # README: record; docs/privacy.md: record, client
    for i, yaml in enumerate(blocks):
        path = Path(pytest.importorskip("tempfile").mkdtemp()) / "p.yaml"
        path.write_text(base + yaml)
        priv = load_config(path).privacy
        if i < 2:
            rec = priv.record
            assert (rec.max_grad_norm, rec.noise_multiplier, rec.delta) == (1.0, 1.0, 1e-5)
        else:
            c = priv.client
            assert (c.clip, c.noise_multiplier, c.delta, c.noise, c.moments) == (0.1, 1.0, 1e-5, "central", "noised")


@pytest.mark.slow
@pytest.mark.assets
def test_docs_privacy_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """docs/privacy.md's commands in order, in one folder, at the docs tests' tiny budget
    (MiniLM × BBC News with Opacus): plan states ε, the run writes privacy.json, the report
    states it."""
    import shlex

    from fedgalore_testing.docs import _tiny, commands, kind
    from fedgalore_testing import REPO, minilm_or_skip

    minilm_or_skip()
    (tmp_path / "conf").symlink_to(REPO / "conf")
    monkeypatch.chdir(tmp_path)
    cmds = [c for c in commands("docs/privacy.md") if kind(c) == "cli"]
    assert [c.split()[1] for c in cmds] == ["plan", "run", "report", "plan", "run", "run", "run", "ledger"]
    site = cmds[6:]  # a site's own policy and ledger (after the shell lines that write the policy)
    client, cmds = cmds[3:6], cmds[:3]  # the record-level commands, then the client-level ones
    for cmd in cmds:
        argv = _tiny(shlex.split(cmd)[1:], tmp_path)
        assert main(argv) == 0, f"{cmd}\n{capsys.readouterr().err[-2000:]}"
        out = capsys.readouterr().out
        if argv[0] == "plan":
            assert "## Privacy (record-level DP-SGD at each site: C = 1, σ = 1; Opacus RDP accountant" in out
        if argv[0] == "report":
            assert "Privacy (every method): record-level DP-SGD, ε ≤ " in out
    doc = _read(tmp_path / "runs" / "offline_text-fedgalore-dirichlet0.5-s0", "privacy.json")
    assert doc["protected"] and len(doc["rounds"]) == 3 and doc["mechanism"]["per_sample_gradients"]["opacus"] == ["Linear"]
    (tmp_path / "client").mkdir()
    (tmp_path / "client" / "conf").symlink_to(REPO / "conf")
    monkeypatch.chdir(tmp_path / "client")
    for cmd in client:
        argv = _tiny(shlex.split(cmd)[1:], tmp_path / "client")
        assert main(argv) == 0, f"{cmd}\n{capsys.readouterr().err[-2000:]}"
        out = capsys.readouterr().out
        if argv[0] == "plan":
            assert "Client-level DP-FedAvg (central noise, C = 0.1, σ = 1; moments σ_m = 1, composed" in out
    doc = _read(tmp_path / "client" / "runs" / "offline_text-fedgalore-dirichlet0.5-s0", "privacy.json")
    assert doc["client"]["mechanism"]["level"] == "client" and len(doc["rounds"]) == 3
    # sync: aggregate — no second release: σ_m none, the statement says where v̄ came from
    doc = _read(tmp_path / "client" / "runs_aggregate" / "offline_text-fedgalore-dirichlet0.5-s0", "privacy.json")
    assert doc["client"]["moment_noise_multiplier"] is None and len(doc["rounds"]) == 3
    assert doc["client"]["mechanism"]["moments"].startswith("not released: FedGaLore's v̄ is built from the noised aggregate")
    # the site's policy: the shell lines exactly as documented, then the run under it and its ledger
    import subprocess

    shell = [c for c in commands("docs/privacy.md") if kind(c) == "uncovered"]
    assert [c.split()[0] for c in shell] == ["mkdir", "printf"]
    for cmd in shell:
        subprocess.run(cmd, shell=True, check=True, cwd=tmp_path / "client")
    capsys.readouterr()
    run, ledger = site
    argv = _tiny(shlex.split(run)[1:], tmp_path / "client")
    assert main(argv) == 0, f"{run}\n{capsys.readouterr().err[-2000:]}"
    capsys.readouterr()
    assert main(shlex.split(ledger)[1:]) == 0
    out = capsys.readouterr().out
    assert "budget ε = 20 at δ = 1e-05" in out and "no releases yet" not in out, out


def test_wrap_problem_names_trainable_buffers_and_frozen_batchnorm():
    from fedgalore.privacy.dpsgd import wrap_problem

    frozen_bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    frozen_bn[1].requires_grad_(False)
    assert "layer 1 is a BatchNorm" in wrap_problem(frozen_bn)

    class Buffered(nn.Linear):
        def __init__(self):
            super().__init__(3, 3)
            self.register_buffer("stat", torch.zeros(3))

    assert wrap_problem(nn.Sequential(Buffered(), nn.Linear(3, 1))) == (
        "trainable layer 0 (Buffered) has buffers (statistics that mix a batch's examples), which Opacus cannot make private")
    assert wrap_problem(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))) is None
    assert wrap_problem(nn.Linear(3, 3).requires_grad_(False)) == "the model has no trainable parameter"


def test_target_epsilon_is_spent_over_every_round(tmp_path):
    """calibration every_round: σ is calibrated per site so that a site in every round spends the
    target (to Opacus' tolerance) and no site spends more."""
    cfg = tiny_cfg(tmp_path, "fedit", rounds=2, federation={"num_clients": 3, "clients_per_round": 2, "rounds": 2,
                                                            "partition": {"kind": "iid"}},
                   task={"name": "tiny_text", "options": {"n_train": 96, "n_test": 32}},  # 3 sites of 32: one σ
                   privacy={"record": {"target_epsilon": 4.0, "calibration": "every_round"}})
    doc = _read(fedgalore.run(cfg).run_dir, "privacy.json")
    sch = site_schedule(RecordPrivacy(target_epsilon=4.0, calibration="every_round"), 32, 16, 1, 2, rounds=2,
                        participation=2 / 3)
    assert doc["mechanism"]["target_epsilon"] == 4.0 and doc["mechanism"]["calibration"] == "every_round"
    for site in doc["sites"].values():
        assert site["epsilon"] <= 4.0
        if len(site["rounds"]) == 2:
            assert site["epsilon"] >= 4.0 - 0.011
        assert site["num_examples"] == 32 and site["noise_multiplier"] == sch.noise_multiplier


def test_extension_secure_mode_and_release_metrics():
    from fedgalore.records.rundir import extension_problem

    cfg = FederatedConfig.from_dict({"train": {"schedule_scope": "round"}, "federation": {"rounds": 3},
                                     "privacy": {"record": {"target_epsilon": 8.0}}})
    assert "calibrates each site's noise to federation.rounds=3" in extension_problem(cfg, 5, 3)
    cfg.privacy.record.target_epsilon, cfg.privacy.record.noise_multiplier = None, 1.0
    assert extension_problem(cfg, 5, 3) is None  # a fixed σ extends exactly
    a = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.5, num_examples=8, noise_seed=3)
    b = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.5, num_examples=8, noise_seed=3)
    c = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.5, num_examples=8, noise_seed=3, secure_mode=True)
    assert a.noise_seed == b.noise_seed != c.noise_seed  # secure mode ignores the run's seed
