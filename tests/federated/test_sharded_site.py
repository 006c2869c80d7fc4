"""A site that shards its client's model across its devices (issue 43; ``train.shard_params`` with
``train.devices_per_client: 2``; fedgalore.federated.sharded_site): two gloo processes, each holding
half of every matrix and of GaLore's state, must give the client update one process gives with the
same global batch (AdamW and GaLoreAdamW, grad accumulation, a rank with an empty shard, clipping,
FedProx, a shard without loss terms), whole federations (FedGaLore, FedIT) and resume; the state
must really be sharded; a failing rank stops the site and the next client-round gets a new one;
what is refused, in one line."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fedgalore.federated.sharded_site as sharded_site
from fedgalore.optim import client_protocol
from fedgalore.optim.state import to_plain
from fedgalore.job.config import ConfigError
from fedgalore.federated.client import ClientError
from fedgalore_testing.local import _max_diff, assert_federation_equals_one_process  # noqa: E402
from fedgalore_testing.local import _loop as _dp_loop  # noqa: E402
from fedgalore_testing.runs import killed_and_resumed, tiny_cfg  # noqa: E402
from fedgalore_testing.local import _Cls, _model, _TokenMean  # noqa: E402


def _loop(devices: int, optimizer: str, *, shard: bool = True, **kw):
    """test_data_parallel's client loop, sharded by default."""
    return _dp_loop(devices, optimizer, shard=shard, **kw)


def _exp_avg(st):
    """The first moment of a torch optimizer's state (a dict) or of GaLoreAdamW's (typed)."""
    return st.get("exp_avg") if isinstance(st, dict) else st.exp_avg


def _flat(st) -> dict:
    """A state as one flat dict: GaLoreAdamW's typed state as plain fields, its update record's
    fields as ``record.<field>`` (its closed terms left out, as before the typed state)."""
    out = dict(to_plain(st))
    rec = out.pop("record", None)
    if rec is not None:
        out.update({f"record.{k}": v for k, v in rec.items() if k != "terms"})
    return out


def _state_equal(o1: torch.optim.Optimizer, o2: torch.optim.Optimizer, tol: float) -> None:
    """The optimizers' whole state agrees: every tensor to ``tol``, everything else exactly."""
    for p1, p2 in zip(o1.param_groups[0]["params"] + o1.param_groups[-1]["params"],
                      o2.param_groups[0]["params"] + o2.param_groups[-1]["params"]):
        s1, s2 = _flat(o1.state[p1]), _flat(o2.state[p2])
        assert sorted(s1) == sorted(s2)
        for key in s1:
            a, b = s1[key], s2[key]
            if isinstance(a, torch.Tensor):
                assert a.shape == b.shape and float((a.float() - b.float()).abs().max()) <= tol, key
            else:
                assert a == b, key


@pytest.mark.parametrize("optimizer", ["adamw", "galore"])
def test_sharded_processes_give_the_one_process_update(optimizer, monkeypatch):
    """21 rows, micro-batches of 5 (shards 3 + 2; the last micro-batch 1 + 0, so rank 1 runs a filler
    row), 2 per step, warmup, cosine, clipping and FedProx: the same weights, losses, progress calls,
    optimizer state and (GaLore) exact update record as one process — and on rank 0 the matrices and
    GaLore's moments were halves while it trained."""
    seen_shapes: dict[str, tuple] = {}
    real = sharded_site.gather_back

    def spy(copy, model=None, optimizer=None):
        if model is not None:
            for name, p in zip(copy.names, copy.params):
                st = copy.optimizer.state[p]
                seen_shapes[name] = (tuple(p.to_local().shape), tuple(_exp_avg(st).shape) if _exp_avg(st) is not None else None,
                                     type(_exp_avg(st)).__name__)
        return real(copy, model, optimizer)

    monkeypatch.setattr(sharded_site, "gather_back", spy)
    one, o1, s1, seen1 = _loop(1, optimizer, prox_mu=0.1)
    two, o2, s2, seen2 = _loop(2, optimizer, prox_mu=0.1)
    assert s1["steps"] == s2["steps"] == 3 and s1["micro_batches"] == s2["micro_batches"] == 5
    for key in ("loss_first", "loss_last", "loss_mean"):
        assert s2[key] == pytest.approx(s1[key], rel=1e-6)
    assert [m for m, _ in seen2] == [m for m, _ in seen1] and all(
        v2 == pytest.approx(v1, rel=1e-6) for (_, v1), (_, v2) in zip(seen1, seen2))
    moved = max(float((p - q).abs().max()) for p, q in zip(one.parameters(), _model(6).parameters()))
    assert moved > 1e-2 and _max_diff(one, two) < 1e-6 * max(1.0, moved) + 1e-7
    _state_equal(o1, o2, 1e-6)
    # 0.weight 16×6 (right side: rows), 2.weight 3×16 (left side: columns), biases by rows
    if optimizer == "galore":
        assert seen_shapes["0.weight"] == ((8, 6), (8, 2), "Tensor")  # M is m×r: its rows
        assert seen_shapes["2.weight"] == ((3, 8), (2, 8), "Tensor")  # M is r×n: its columns
        u1, u2 = client_protocol.export_update(o1), client_protocol.export_update(o2)
        w0 = dict(_model(6).named_parameters())
        for name in u1:
            d1, d2 = u1[name].materialize(w0[name].detach()), u2[name].materialize(w0[name].detach())
            assert float((d1 - d2).abs().max()) < 1e-6
            assert [getattr(t, "seed", None) for t in u1[name].terms] == [getattr(t, "seed", None) for t in u2[name].terms]
    else:  # torch's AdamW on FSDP2's DTensor blocks
        assert seen_shapes["0.weight"] == ((8, 6), (16, 6), "DTensor") and seen_shapes["0.bias"][0] == (8,)


def test_a_left_matrix_with_odd_columns_is_split_by_rows_and_keeps_whole_moments(monkeypatch):
    """3×15 (left side; FSDP2 cannot split 15 columns evenly): rows, the projected gradient
    all-reduced each step, the moments whole on every rank (fedgalore.optim.sharded); one process's
    update and state all the same."""
    seen: dict[str, tuple] = {}
    real = sharded_site.gather_back

    def spy(copy, model=None, optimizer=None):
        if model is not None:
            for name, p in zip(copy.names, copy.params):
                seen[name] = (tuple(p.to_local().shape), tuple(_exp_avg(copy.optimizer.state[p]).shape))
        return real(copy, model, optimizer)

    def odd():
        torch.manual_seed(2)
        return nn.Sequential(nn.Linear(6, 15), nn.Tanh(), nn.Linear(15, 3))

    monkeypatch.setattr(sharded_site, "gather_back", spy)
    one, o1, _, _ = _loop(1, "galore", model=odd())
    two, o2, _, _ = _loop(2, "galore", model=odd())
    assert seen["2.weight"] == ((2, 15), (2, 15))  # rows 2 + 1; M is r×n, whole
    assert seen["0.weight"] == ((8, 6), (8, 2))
    assert _max_diff(one, two) < 1e-6
    _state_equal(o1, o2, 1e-6)


def test_a_shard_without_loss_terms_runs_a_filler_row():
    """Rows whose tokens are all masked: rank 1's shard of a micro-batch has no loss term (FSDP2's
    collectives still need its forward); the update is one process's."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, 3, 6, generator=g)
    y = torch.randint(0, 3, (12, 3), generator=g)
    y[3:6] = -100  # the second half of the first micro-batch of 6: no valid token
    y[:2, 1:] = -100

    def tokens_model():
        return _model(6)

    one, _, s1, _ = _loop(1, "galore", task=_TokenMean(), data=(x, y), batch_size=6, k=1, model=tokens_model())
    two, _, s2, _ = _loop(2, "galore", task=_TokenMean(), data=(x, y), batch_size=6, k=1, model=tokens_model())
    assert s2["loss_mean"] == pytest.approx(s1["loss_mean"], rel=1e-6)
    assert _max_diff(one, two) < 1e-6


def test_sharded_is_the_data_parallel_update_too():
    """The two multi-device modes agree with each other (and with one process, above)."""
    dp, *_ = _loop(2, "galore", shard=False)
    fs, *_ = _loop(2, "galore", shard=True)
    assert _max_diff(dp, fs) < 1e-6


class _NanAtSecondRank(_Cls):
    def loss(self, model, batch):
        out = super().loss(model, batch)
        return out * float("nan") if int(batch["y"].shape[0]) == 2 else out  # only a 2-row shard (rank 1's)


class _FailsOnRank(_Cls):
    def __init__(self, rows: int) -> None:
        self.rows = rows

    def loss(self, model, batch):
        if int(batch["y"].shape[0]) == self.rows:
            raise RuntimeError(f"out of memory on the rank with {self.rows} rows")
        return super().loss(model, batch)


def test_failures_stop_the_client_and_the_next_round_gets_a_working_site():
    """A non-finite loss on rank 1 ends the client (ClientError) with the site intact; an exception on
    rank 0 or inside a helper stops the site (FSDP2's collectives cannot be met half-way) with the
    error named; after each, the next client-round trains as one process does."""
    one, *_ = _loop(1, "galore")
    with pytest.raises(ClientError, match="non-finite loss nan at local step 0"):
        _loop(2, "galore", task=_NanAtSecondRank())
    two, *_ = _loop(2, "galore")
    assert _max_diff(one, two) < 1e-6
    with pytest.raises(RuntimeError, match="out of memory on the rank with 3 rows"):  # rank 0's shard
        _loop(2, "galore", task=_FailsOnRank(3))
    two, *_ = _loop(2, "galore")
    assert _max_diff(one, two) < 1e-6
    with pytest.raises(RuntimeError, match="(?s)helper rank failed.*out of memory on the rank with 2 rows"):
        _loop(2, "galore", task=_FailsOnRank(2))
    two, *_ = _loop(2, "galore")
    assert _max_diff(one, two) < 1e-6


class _Bypass(_Cls):
    def loss(self, model, batch):  # a submodule called directly: FSDP2 never gathers its weight
        return nn.functional.cross_entropy(model[2](model[1](model[0](batch["x"]))), batch["y"])


def test_a_loss_that_bypasses_the_model_forward_is_one_clear_error():
    with pytest.raises(RuntimeError, match=r"shard_params=true: the task's loss used a sharded weight outside the model's forward"):
        _loop(2, "galore", task=_Bypass())
    two, *_ = _loop(2, "galore")
    one, *_ = _loop(1, "galore")
    assert _max_diff(one, two) < 1e-6


def test_bad_settings_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"shard_params=true shards .* devices_per_client=1; set train.devices_per_client >= 2"):
        tiny_cfg(tmp_path, train={"lr": 1e-2, "shard_params": True})
    with pytest.raises(ConfigError, match=r"shard_params=true with train.scaffold"):
        tiny_cfg(tmp_path, "fedavg_full", train={"lr": 1e-2, "shard_params": True, "devices_per_client": 2, "scaffold": True})
    with pytest.raises(ConfigError, match=r"train.shard_params must be true or false, got 'yes'"):
        tiny_cfg(tmp_path, train={"lr": 1e-2, "shard_params": "yes", "devices_per_client": 2})


@pytest.mark.parametrize("method, options", [
    ("fedgalore", {"update_proj_gap": 2, "projector": "rsvd_then_random", "adaptive_proj_steps": 1}),
    ("fedit", {}),
])
def test_a_federation_of_sharded_sites_equals_one_process(tmp_path, method, options):
    """tiny_text (a 2-layer BERT: each layer one FSDP unit; no dropout), 2 rounds of 3 sites: the
    global model, the losses and the bytes are one process's, to float rounding."""
    assert_federation_equals_one_process(tmp_path, method, options, devices_per_client=2, shard_params=True)


def test_resume_with_sharded_sites(tmp_path):
    opts = {"update_proj_gap": 2, "projector": "rsvd_then_random", "adaptive_proj_steps": 1}
    train = {"lr": 1e-2, "batch_size": 16, "local_epochs": 1, "weight_decay": 0.01, "devices_per_client": 2,
             "shard_params": True}
    killed_and_resumed(tiny_cfg(tmp_path / "a", "fedgalore", rounds=4, method_options=opts, train=train),
                       tiny_cfg(tmp_path / "b", "fedgalore", rounds=4, method_options=opts, train=train))


def test_units_are_the_layers_of_module_lists():
    model = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2)]), nn.ReLU()]))
    units = sharded_site._units(model)
    assert [id(u) for u in units] == [id(model[1][0]), id(model[1][1])]  # outer list's children; ReLU has no parameters
