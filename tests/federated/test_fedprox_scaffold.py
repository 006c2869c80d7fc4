"""FedProx (Li et al. 2020) and SCAFFOLD (Karimireddy et al. 2020, option II) — issue 21.

The local steps equal the papers' formulas on a small linear model; μ = 0 and scaffold off are
today's training (the golden check in scripts/check_equivalence.py covers bit-identity); on the
tiny task FedProx reduces client drift; SCAFFOLD's control variates follow Algorithm 1, are
counted in the ledger, checkpointed, and a killed run resumes exactly.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from dataclasses import replace

import pytest
import torch
from torch import nn

import fedgalore
from fedgalore.job.config import ConfigError
from fedgalore.federated.checkpoint import load_latest_checkpoint
from fedgalore.federated.client import local_train
from fedgalore.federated.scaffold import ScaffoldClient, update_controls
from fedgalore.protocol.state import ClientContext
from fedgalore.protocol.train_config import TrainConfig

from fedgalore_testing.runs import assert_same_checkpointed_state, killed_and_resumed, tiny_cfg

LR, STEPS = 0.1, 4


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.randn(2, 3, generator=g))
        model.bias.copy_(torch.randn(2, generator=g))
    batches = [{"x": torch.randn(5, 3, generator=g), "y": torch.randn(5, 2, generator=g)} for _ in range(STEPS)]
    return model, batches


def _loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _ctx(batches, **train):
    tc = TrainConfig(lr=LR, batch_size=5, local_steps=STEPS, warmup_ratio=0.0, schedule="constant", grad_clip=None, **train)
    return ClientContext(round=0, total_rounds=1, client=0, round_seed=0, num_examples=5 * STEPS, train=tc, target_modules=[],
                         head_params=[], loss_fn=_loss, batches=lambda: iter(batches), steps=STEPS, steps_per_round=STEPS)


def _grads(model, batch):
    model.zero_grad()
    _loss(model, batch).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def test_fedprox_step_is_the_proximal_gradient():
    """SGD on h(θ) = F(θ) + μ/2‖θ − θ_0‖²: θ ← θ − η(∇F(θ) + μ(θ − θ_0)) (Li et al. 2020, eq. 2)."""
    mu = 0.7
    model, batches = _setup()
    ref, _ = _setup()
    theta0 = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for b in batches:
        g = _grads(ref, b)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p -= LR * (g[n] + mu * (p - theta0[n]))
    local_train(model, torch.optim.SGD(model.parameters(), lr=LR), _ctx(batches, prox_mu=mu))
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


def test_fedprox_mu_zero_is_plain_training_bitwise():
    a, batches = _setup()
    b, _ = _setup()
    local_train(a, torch.optim.AdamW(a.parameters(), lr=LR), _ctx(batches))
    local_train(b, torch.optim.AdamW(b.parameters(), lr=LR), _ctx(batches, prox_mu=0.0))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_scaffold_local_step_and_option_ii_control_variate():
    """y ← y − η(g − c_i + c) (Alg. 1 line 10); c_i⁺ = c_i − c + (x − y)/(Kη) (line 12, option II)."""
    model, batches = _setup()
    ref, _ = _setup()
    g = torch.Generator().manual_seed(1)
    c = {n: torch.randn(p.shape, generator=g) for n, p in ref.named_parameters()}
    ci = {n: torch.randn(p.shape, generator=g) for n, p in ref.named_parameters()}
    x = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for b in batches:
        gr = _grads(ref, b)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                p -= LR * (gr[n] - ci[n] + c[n])
    ctx = _ctx(batches)
    ctx.scaffold = ScaffoldClient({n: c[n] - ci[n] for n in c}, dict(model.named_parameters()))
    local_train(model, torch.optim.SGD(model.parameters(), lr=LR), ctx)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    y = dict(ref.named_parameters())
    for n in c:
        expect = ci[n] - c[n] + (x[n] - y[n].detach()) / (STEPS * LR)
        torch.testing.assert_close(ctx.scaffold.new_ci[n], expect, rtol=1e-4, atol=1e-5, msg=n)


def test_server_control_variate_update():
    """c ← c + (1/N) Σ_{i∈S} (c_i⁺ − c_i) (Alg. 1 line 17); the uploaders' c_i are replaced."""
    like = {"w": torch.zeros(2, 2)}
    extras: dict[str, torch.Tensor] = {}
    update_controls(extras, {0: {"w": torch.ones(2, 2)}, 3: {"w": 3 * torch.ones(2, 2)}}, like, num_clients=4)
    torch.testing.assert_close(extras["scaffold/c/w"], torch.ones(2, 2))  # (1 + 3) / 4
    update_controls(extras, {0: {"w": 5 * torch.ones(2, 2)}}, like, num_clients=4)
    torch.testing.assert_close(extras["scaffold/c/w"], 2 * torch.ones(2, 2))  # 1 + (5 − 1) / 4
    torch.testing.assert_close(extras["scaffold/ci/0/w"], 5 * torch.ones(2, 2))
    torch.testing.assert_close(extras["scaffold/ci/3/w"], 3 * torch.ones(2, 2))


def _diag(run):
    return [json.loads(line) for line in (run.run_dir / "diagnostics.jsonl").read_text().splitlines()]


def _train(**extra):
    return {"lr": 1e-2, "batch_size": 16, "local_epochs": 1, "weight_decay": 0.01, **extra}


def test_fedprox_reduces_client_drift_on_the_tiny_task(tmp_path):
    """FFA-LoRA (SGD, the setting of Li et al.): the relative drift ‖Δ_i − Δ̄‖/‖Δ̄‖ falls with μ;
    FedAvg-Full (AdamW): the absolute drift ‖Δ_i − Δ̄‖ falls (Adam's normalisation shrinks Δ̄ too,
    so the relative one need not)."""
    plain = _diag(fedgalore.run(tiny_cfg(tmp_path / "a", "ffa_lora", rounds=2, train=_train())))
    prox = _diag(fedgalore.run(tiny_cfg(tmp_path / "b", "ffa_lora", rounds=2, train=_train(prox_mu=40.0))))
    assert all(q["drift_mean"] < p["drift_mean"] for p, q in zip(plain, prox))
    plain = _diag(fedgalore.run(tiny_cfg(tmp_path / "c", "fedavg_full", rounds=2, train=_train())))
    prox = _diag(fedgalore.run(tiny_cfg(tmp_path / "d", "fedavg_full", rounds=2, train=_train(prox_mu=1.0))))
    absolute = lambda d: d["drift_mean"] * d["aggregate_update_norm"]  # noqa: E731
    assert all(absolute(q) < 0.9 * absolute(p) for p, q in zip(plain, prox))


@pytest.mark.parametrize("method,train,msg", [
    ("fedgalore", {"scaffold": True}, "use one of: fedavg_full, fedit, ffa_lora"),
    ("lora_fair", {"scaffold": True}, "use one of: fedavg_full, fedit, ffa_lora"),
    ("fedit", {"prox_mu": -1.0}, "train.prox_mu=-1.0 must be >= 0"),
])
def test_bad_remedy_options_are_one_line_config_errors(tmp_path, method, train, msg):
    with pytest.raises(ConfigError) as err:
        tiny_cfg(tmp_path, method, train=_train(**train))
    assert msg in str(err.value) and "\n" not in str(err.value)


def _same_runs(seq, hist):
    assert len(hist) == len(seq.history) == 2
    for a, b in zip(seq.history, hist):
        assert a["clients"] == b["clients"] and b["dropped"] == []
        assert a["bytes_up"] == b["bytes_up"] and a["bytes_down"] == b["bytes_down"]
        for k in ("train_loss", "eval/accuracy", "eval/loss"):
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a[k], b[k])


@pytest.mark.slow
def test_scaffold_and_server_optimizer_on_ray_reproduce_sequential(tmp_path):
    """Each Ray job gets its own c − c_i (one object-store put per client); same metrics and bytes."""
    pytest.importorskip("ray")
    over = dict(train=_train(scaffold=True, prox_mu=0.1), federation=_fed2({"name": "fedavgm", "momentum": 0.9}))
    seq = fedgalore.run(tiny_cfg(tmp_path / "seq", "fedit", rounds=2, **over))
    par = fedgalore.run(tiny_cfg(tmp_path / "ray", "fedit", rounds=2, backend={"name": "ray", "options": {"num_workers": 2}}, **over))
    _same_runs(seq, par.history)


@pytest.mark.slow
def test_scaffold_and_server_optimizer_on_flower_reproduce_sequential(tmp_path):
    """Flower simulation: each SuperNode's train message carries its client's c − c_i."""
    pytest.importorskip("flwr")
    from flwr.simulation import run_simulation

    from fedgalore.flower.client_app import app as client_app
    from fedgalore.flower.server_app import make_server_app

    over = dict(train=_train(scaffold=True, prox_mu=0.1), federation=_fed2({"name": "fedadam", "lr": 1e-3}))
    seq = fedgalore.run(tiny_cfg(tmp_path / "seq", "ffa_lora", rounds=2, **over))
    run_dir = tmp_path / "flower" / "run"
    run_simulation(server_app=make_server_app(tiny_cfg(tmp_path / "flower", "ffa_lora", rounds=2, **over), run_dir=run_dir),
                   client_app=client_app, num_supernodes=6,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    _same_runs(seq, [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()])


def _fed2(opt):
    return {"num_clients": 6, "clients_per_round": 3, "rounds": 2,
            "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}, "server_optimizer": opt}


@pytest.mark.parametrize("method", ["fedavg_full", "fedit", "ffa_lora"])
def test_scaffold_runs_counts_its_bytes_and_keeps_its_state(tmp_path, method):
    plain = fedgalore.run(tiny_cfg(tmp_path / "a", method, rounds=2, train=_train()))
    sc = fedgalore.run(tiny_cfg(tmp_path / "b", method, rounds=2, train=_train(scaffold=True)))
    state, _ = load_latest_checkpoint(sc.run_dir)
    param_bytes = sum(v.numel() * 4 for v in state.params.values())  # fp32
    msgs = 2 * 3  # rounds × clients per round
    extra_up = sc.summary["bytes_up_total"] - plain.summary["bytes_up_total"]
    extra_down = sc.summary["bytes_down_total"] - plain.summary["bytes_down_total"]
    # one extra copy of the trainable parameters each way per client-round (+ entry headers)
    bound = msgs * (param_bytes + 512 * len(state.params))
    assert msgs * param_bytes <= extra_up < bound
    assert msgs * param_bytes <= extra_down < bound
    assert sorted(k[len("scaffold/c/"):] for k in state.extras if k.startswith("scaffold/c/")) == sorted(state.params)
    clients = {int(k.split("/")[2]) for k in state.extras if k.startswith("scaffold/ci/")}
    sampled = {c for r in sc.history for c in r["clients"]}
    assert clients == sampled
    assert plain.history[-1]["train_loss"] != sc.history[-1]["train_loss"]


@pytest.mark.parametrize("method", ["fedavg_full", "ffa_lora"])
def test_resume_is_exact_with_scaffold_state(tmp_path, method):
    train = _train(scaffold=True, prox_mu=0.1)
    full, resumed = killed_and_resumed(tiny_cfg(tmp_path / "a", method, rounds=4, train=train),
                                       tiny_cfg(tmp_path / "b", method, rounds=4, train=train))
    assert resumed.summary["bytes_up_total"] == full.summary["bytes_up_total"]
    assert_same_checkpointed_state(full, resumed)


def test_remedies_doc_commands_run(tmp_path, monkeypatch, capsys):
    """Every `fedgalore` command of docs/remedies.md, as written plus a tiny budget (the tiny_text
    task instead of the pipeline's model), with its `remedies.yaml` saved as the doc says."""
    import shlex

    from fedgalore.cli import main
    from fedgalore_testing.docs import blocks, commands
    from fedgalore_testing import REPO, TINY_PAPER

    (tmp_path / "conf").symlink_to(REPO / "conf")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "remedies.yaml").write_text(blocks("docs/remedies.md", "yaml")[0])
    cmds = [c for c in commands("docs/remedies.md") if c.startswith("fedgalore ")]
    assert len(cmds) == 5
    for cmd in cmds:
        argv = shlex.split(cmd)[1:]
        if "--seeds" in argv:
            argv[argv.index("--seeds") + 1] = "0"
        if "--settings" in argv:
            argv[argv.index("--settings") + 1] = "dirichlet:0.5"
        rc = main([*argv, *TINY_PAPER, "output.progress=quiet"])
        assert rc == 0, f"{cmd}\n{capsys.readouterr().err[-2000:]}"
    rows = json.loads((tmp_path / "runs" / "remedies" / "grid.json").read_text())["methods"]
    assert len(rows) == 10


def test_a_remedy_differs_from_a_run_saved_before_the_option_existed():
    """A config saved by an older version lacks the new keys: they read as their defaults (the old
    behaviour), so a run with FedProx or a server optimizer is another run, and one without is the same."""
    from fedgalore.job.config import FederatedConfig, config_difference

    old = FederatedConfig().to_dict()
    del old["train"]["prox_mu"], old["train"]["scaffold"], old["federation"]["server_optimizer"]
    new = FederatedConfig().to_dict()
    assert config_difference(old, new) is None
    new["train"]["prox_mu"] = 0.01
    assert config_difference(old, new) == "train.prox_mu: 0.0 -> 0.01"
    new["train"]["prox_mu"] = 0.0
    new["federation"]["server_optimizer"]["name"] = "fedadam"
    assert config_difference(old, new) == "federation.server_optimizer.name: 'fedavg' -> 'fedadam'"


def test_compare_rows_carry_remedies_and_check_them_before_running(tmp_path):
    """A comparison row's train / server_optimizer overrides reach its cells; a bad one fails at planning."""
    from fedgalore.compare import plan_grid

    base = tiny_cfg(tmp_path)
    rows = {"fedit_adam": {"method": "fedit", "server_optimizer": {"name": "fedadam", "lr": 1e-3}},
            "ffa_scaffold": {"method": "ffa_lora", "train": {"scaffold": True, "prox_mu": 0.01}}}
    cells = {c.label: c.cfg for c in plan_grid(base, ["fedavg_full", *rows], ["iid"], [0], tmp_path / "g", rows)}
    assert cells["fedit_adam"].federation.server_optimizer.name == "fedadam" and cells["fedit_adam"].method.name == "fedit"
    assert cells["ffa_scaffold"].train.scaffold and cells["ffa_scaffold"].train.prox_mu == 0.01
    assert cells["fedavg_full"].federation.server_optimizer.identity and not cells["fedavg_full"].train.scaffold
    with pytest.raises(ConfigError, match="lr must be set for fedyogi"):
        plan_grid(base, ["bad"], ["iid"], [0], tmp_path / "h", {"bad": {"method": "fedit", "server_optimizer": {"name": "fedyogi"}}})
    with pytest.raises(ConfigError, match="use one of"):
        plan_grid(base, ["bad"], ["iid"], [0], tmp_path / "i", {"bad": {"method": "flora", "train": {"scaffold": True}}})


def test_report_budget_line_names_each_rows_remedy():
    from fedgalore.report.tables import _run_lr

    cfg = tiny_cfg(Path("/tmp")).to_dict()
    assert _run_lr(cfg) == "1e-2"
    cfg["train"].update(prox_mu=0.01, scaffold=True)
    cfg["federation"]["server_optimizer"] = {"name": "fedadam", "lr": 1e-3}
    assert _run_lr(cfg) == "1e-2 + FedProx μ=0.01 + SCAFFOLD + server fedadam η=1e-3"
    del cfg["train"]["prox_mu"], cfg["train"]["scaffold"], cfg["federation"]["server_optimizer"]  # an older run's config
    assert _run_lr(cfg) == "1e-2"


def test_a_non_finite_control_variate_drops_that_client(tmp_path, monkeypatch):
    """c_i⁺ feeds c for every later round: a non-finite one is rejected with its upload."""
    from fedgalore.federated import scaffold

    finish = scaffold.ScaffoldClient.finish

    def poisoned(self):
        out = finish(self)
        if not hasattr(poisoned, "done"):  # the first client of the run
            poisoned.done = True
            for v in out.values():
                v.fill_(float("nan"))
        return out

    monkeypatch.setattr(scaffold.ScaffoldClient, "finish", poisoned)
    res = fedgalore.run(tiny_cfg(tmp_path, "fedavg_full", rounds=2, train=_train(scaffold=True)))
    assert res.history[0]["dropped"] and len(res.history[0]["dropped"]) == 1
    state, _ = load_latest_checkpoint(res.run_dir)
    assert all(bool(torch.isfinite(v).all()) for k, v in state.extras.items() if k.startswith("scaffold/"))
