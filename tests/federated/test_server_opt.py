"""Server optimizers (issue 21): FedAvgM, FedAdam, FedYogi, FedAdagrad on the pseudo-gradient.

Checked against a peer: on identical client results, our server step equals Flower's strategies'
``aggregate_fit`` (flwr.server.strategy) over several rounds, to float tolerance. Also: options
are checked at config load, the state is checkpointed and a killed run resumes exactly.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fedgalore
from fedgalore.job.config import ConfigError
from fedgalore.federated.checkpoint import load_latest_checkpoint
from fedgalore.federated.server_opt import ServerOptimizerConfig, server_step

from fedgalore_testing.runs import assert_same_checkpointed_state, killed_and_resumed, tiny_cfg


ROUNDS = 5
SHAPES = [(4, 3), (5,)]
SIZES = [10, 30, 20]


def _client_results(rng: np.random.Generator, current: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Three clients' models: the current global one plus a client-specific drift."""
    return [[(x + rng.normal(0.0, 0.05 * (i + 1), x.shape) + 0.02 * i).astype(np.float32) for x in current] for i in range(len(SIZES))]


def _flwr_round(strategy, server_round: int, clients: list[list[np.ndarray]]) -> list[np.ndarray]:
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    results = [(None, FitRes(status=Status(code=Code.OK, message=""), parameters=ndarrays_to_parameters(arrs),
                             num_examples=n, metrics={})) for arrs, n in zip(clients, SIZES)]
    params, _ = strategy.aggregate_fit(server_round, results, [])
    return parameters_to_ndarrays(params)


def _ours(cfg: ServerOptimizerConfig, before: list[np.ndarray], clients: list[list[np.ndarray]], buffers: dict, step: int) -> list[np.ndarray]:
    w = np.asarray(SIZES, dtype=np.float64) / sum(SIZES)
    agg = {str(j): torch.from_numpy(sum(wi * c[j].astype(np.float64) for wi, c in zip(w, clients)).astype(np.float32)) for j in range(len(before))}
    new = server_step(cfg, {str(j): torch.from_numpy(x.astype(np.float32)) for j, x in enumerate(before)}, agg, buffers, step)
    return [new[str(j)].numpy() for j in range(len(before))]


def _strategy(name: str, init: list[np.ndarray], **kw):
    pytest.importorskip("flwr")
    from flwr.common import ndarrays_to_parameters
    from flwr.server import strategy as S

    cls = {"fedavgm": S.FedAvgM, "fedadam": S.FedAdam, "fedyogi": S.FedYogi, "fedadagrad": S.FedAdagrad}[name]
    return cls(initial_parameters=ndarrays_to_parameters([x.copy() for x in init]), **kw)


CASES = [
    # (our config, Flower strategy and its arguments)
    (dict(name="fedavgm", lr=0.7, momentum=0.9), ("fedavgm", dict(server_learning_rate=0.7, server_momentum=0.9))),
    (dict(name="fedavg", lr=0.5), ("fedavgm", dict(server_learning_rate=0.5, server_momentum=0.0))),
    (dict(name="fedadam", lr=0.01, betas=(0.9, 0.99), tau=1e-3, bias_correction=True),
     ("fedadam", dict(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3))),
    (dict(name="fedadam", lr=0.01, betas=(0.8, 0.95), tau=1e-3), ("fedadam", dict(eta=0.01, beta_1=0.8, beta_2=0.95, tau=1e-3))),
    (dict(name="fedyogi", lr=0.01, betas=(0.9, 0.99), tau=1e-3), ("fedyogi", dict(eta=0.01, beta_1=0.9, beta_2=0.99, tau=1e-3))),
    (dict(name="fedadagrad", lr=0.05, tau=1e-3), ("fedadagrad", dict(eta=0.05, tau=1e-3))),
]


@pytest.mark.parametrize("ours,theirs", CASES, ids=[f"{c[0]['name']}{'-bc' if c[0].get('bias_correction') else ''}-{c[1][0]}" for c in CASES])
def test_server_step_equals_flower_strategy(ours, theirs):
    rng = np.random.default_rng(0)
    init = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    cfg = ServerOptimizerConfig(**ours).check()
    strat = _strategy(theirs[0], init, **theirs[1])
    mine, flwr_cur, buffers = [x.copy() for x in init], [x.copy() for x in init], {}
    for t in range(1, ROUNDS + 1):
        clients = _client_results(rng, flwr_cur)  # identical inputs to both
        if theirs[0] == "fedadam":
            # Flower's FedAdam always bias-corrects, with exponent server_round + 1: called with
            # server_round = t − 1 its step size is Adam's for step t; for our uncorrected FedAdam
            # (Reddi et al. Alg. 2) its eta is divided by that factor so that its η_t = η.
            b1, b2 = theirs[1]["beta_1"], theirs[1]["beta_2"]
            if not cfg.bias_correction:
                strat.eta = theirs[1]["eta"] / (math.sqrt(1 - b2**t) / (1 - b1**t))
            flwr_cur = _flwr_round(strat, t - 1, clients)
        else:
            flwr_cur = _flwr_round(strat, t, clients)
        mine = _ours(cfg, mine, clients, buffers, t)
        for a, b in zip(mine, flwr_cur):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(a, b) for a, b in zip(mine, init))  # it moved


@pytest.mark.parametrize("over,msg", [
    ({"name": "adam"}, "must be one of fedavg"),
    ({"name": "fedadam"}, "lr must be set for fedadam"),
    ({"name": "fedadam", "lr": 1e-3, "momentum": 0.9}, "momentum is fedavgm's"),
    ({"name": "fedavgm", "tau": 1e-3}, "betas / tau are for"),
    ({"name": "fedyogi", "lr": 1e-3, "bias_correction": True}, "bias_correction is fedadam's"),
    ({"name": "fedavgm", "momentum": 1.5}, "must be in [0, 1)"),
])
def test_bad_server_optimizer_is_one_line_config_error(tmp_path, over, msg):
    fed = {"num_clients": 6, "clients_per_round": 3, "rounds": 2, "server_optimizer": over}
    with pytest.raises(ConfigError) as err:
        tiny_cfg(tmp_path, federation=fed)
    assert msg in str(err.value) and "\n" not in str(err.value)


def test_factored_downlink_with_server_optimizer_is_a_config_error(tmp_path):
    fed = {"num_clients": 6, "clients_per_round": 3, "rounds": 2, "server_optimizer": {"name": "fedadam", "lr": 1e-3}}
    with pytest.raises(ConfigError, match="downlink=dense"):
        tiny_cfg(tmp_path, "fedgalore", federation=fed, method_options={"downlink": "factored"})
    tiny_cfg(tmp_path, "fedgalore", federation=fed, method_options={"downlink": "dense"})  # dense downlink: fine
    # the default (auto) resolves to dense under a server optimizer, factored without one
    from fedgalore.job.resolve import method_options

    assert method_options(tiny_cfg(tmp_path, "fedgalore", federation=fed)).downlink == "dense"
    assert method_options(tiny_cfg(tmp_path, "fedgalore")).downlink == "factored"


def _fed(opt: dict, rounds: int = 4) -> dict:
    return {"num_clients": 6, "clients_per_round": 3, "rounds": rounds,
            "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}, "server_optimizer": opt}


def test_server_optimizer_changes_the_run_and_keeps_its_state(tmp_path):
    base = fedgalore.run(tiny_cfg(tmp_path / "a", "fedavg_full", rounds=2))
    adam = fedgalore.run(tiny_cfg(tmp_path / "b", "fedavg_full", federation=_fed({"name": "fedadam", "lr": 1e-3}, 2)))
    assert base.history[-1]["train_loss"] != adam.history[-1]["train_loss"]
    state, info = load_latest_checkpoint(adam.run_dir)
    assert state.meta["server_opt"] == {"step": 2}
    ms = [k for k in state.extras if k.startswith("server_opt/m/")]
    vs = [k for k in state.extras if k.startswith("server_opt/v/")]
    assert sorted(k.split("/", 2)[2] for k in ms) == sorted(state.params) == sorted(k.split("/", 2)[2] for k in vs)
    # the bytes on the wire are the method's: a server optimizer adds none
    assert adam.summary["bytes_up_total"] == base.summary["bytes_up_total"]


@pytest.mark.parametrize("method,opt", [("fedavg_full", {"name": "fedadam", "lr": 1e-3, "bias_correction": True}),
                                        ("fedgalore", {"name": "fedyogi", "lr": 1e-3}),
                                        ("fedit", {"name": "fedavgm", "lr": 1.0, "momentum": 0.9})])
def test_resume_is_exact_with_server_optimizer_state(tmp_path, method, opt):
    full, resumed = killed_and_resumed(tiny_cfg(tmp_path / "a", method, federation=_fed(opt)),
                                       tiny_cfg(tmp_path / "b", method, federation=_fed(opt)))
    assert_same_checkpointed_state(full, resumed)
    s1, _ = load_latest_checkpoint(full.run_dir)
    s2, _ = load_latest_checkpoint(resumed.run_dir)
    assert s1.meta["server_opt"] == s2.meta["server_opt"] == {"step": 4}


def test_a_method_object_passed_in_code_gets_the_downlink_the_config_would(tmp_path):
    """Issue 33: a FedGaLore object built in code keeps ``downlink: auto``; under FedAvgM the
    engine resolves it to dense (the config check never saw it), so every client starts from the
    server's W exactly; an explicit ``factored`` object is refused with one line."""
    from fedgalore.engine.runtime import Runtime
    from fedgalore.methods import get_method

    fed = _fed({"name": "fedavgm", "lr": 1.0, "momentum": 0.9}, rounds=3)
    cfg = tiny_cfg(tmp_path / "a", "fedgalore", federation=fed)
    method = get_method("fedgalore", cfg.method.rank, update_proj_gap=50)
    assert method.options.downlink == "auto" and method.factored_downlink  # unresolved outside the engine
    res = fedgalore.run(cfg, method=method)
    assert method.options.downlink == "dense" and not method.factored_downlink
    assert res.summary["status"] == "finished" and all(r["dropped"] == [] for r in res.history)
    bad = get_method("fedgalore", cfg.method.rank, update_proj_gap=50, downlink="factored")
    with pytest.raises(ConfigError, match="downlink='dense'") as err:
        Runtime(tiny_cfg(tmp_path / "b", "fedgalore", federation=fed), method=bad)
    assert "\n" not in str(err.value)


def test_a_chain_that_does_not_rebuild_the_servers_model_is_refused():
    """The fingerprint sent with a chain (downlink_check/NAME) catches a server W that moved after
    its update was recorded — what a server optimizer under the factored downlink did (the chain
    rebuilt W_{v-1} + chain_v, 1.18 ‖ΔW‖ away from the server's W_v) — where version numbers
    alone agreed; float rounding of the same chain passes."""
    from fedgalore.protocol import downlink as dl
    from fedgalore.protocol.payload import Dense, GaLoreUpdate, LowRank, Payload
    from fedgalore.protocol.state import ServerState

    g = torch.Generator().manual_seed(3)
    w0 = torch.randn(96, 64, generator=g)
    state = ServerState(params={"w": w0.clone()})
    upd = GaLoreUpdate(0.0, (LowRank(1e-2 * torch.randn(96, 4, generator=g), torch.randn(4, 64, generator=g)),), (96, 64))
    dl.apply_update(state.params["w"], upd)
    dl.record_update(state, {"w": upd})
    cache = dl.ClientCache(0, {"w": w0.clone()})
    dense = Payload({"w": Dense(state.params["w"])}, {"round": 1})
    ok = dl.client_payload(state, dense, ["w"], 0)
    assert "downlink_check/w" in ok.entries and "w" not in ok.entries
    rebuilt = dl.reconstruct(ok, ["w"], cache)["w"]
    torch.testing.assert_close(rebuilt, state.params["w"])
    noisy = dl.ClientCache(0, {"w": w0 * (1 + 1e-6 * torch.randn(96, 64, generator=g))})  # rounding-level difference
    dl.reconstruct(ok, ["w"], noisy)
    state2 = ServerState(params={"w": state.params["w"].clone()}, moments=dict(state.moments), meta=dict(state.meta))
    state2.params["w"] += 1.18 * (state.params["w"] - w0)  # the server optimizer moved W after recording
    with pytest.raises(dl.DownlinkError, match="not the server's"):
        dl.reconstruct(dl.client_payload(state2, Payload({"w": Dense(state2.params["w"])}, {}), ["w"], 0), ["w"], cache)
