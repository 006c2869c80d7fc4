"""A site with several devices (issue 43; ``train.devices_per_client``, fedgalore.federated.data_parallel):
two processes on the CPU (gloo) must give the client update one process gives with the same global
batch, to float rounding, for the local loop alone (AdamW and GaLoreAdamW, grad accumulation, uneven
shards, FedProx, a token-mean loss) and for whole federations (FedGaLore, FedIT); resume with two
processes; what is refused, in one line."""
from __future__ import annotations


import pytest
import torch

from fedgalore.job.config import ConfigError
from fedgalore.federated.client import ClientError
from fedgalore.federated.data_parallel import shard_batch
from fedgalore.optim import client_protocol
from fedgalore_testing.runs import killed_and_resumed, tiny_cfg  # noqa: E402
from fedgalore_testing.local import _Cls, _loop, _max_diff, _model, _TokenMean, assert_federation_equals_one_process


def test_shards_are_contiguous_rows_and_empty_when_the_batch_is_short():
    b = {"x": torch.arange(10).view(5, 2), "y": torch.arange(5)}
    parts = shard_batch(b, 2)
    assert [p["y"].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    assert torch.equal(torch.cat([p["x"] for p in parts]), b["x"])
    assert shard_batch({"y": torch.arange(1)}, 2)[1] == {}
    with pytest.raises(ValueError, match="share their first"):
        shard_batch({"x": torch.zeros(3, 2), "y": torch.zeros(4)}, 2)


@pytest.mark.parametrize("optimizer", ["adamw", "galore"])
def test_two_processes_give_the_one_process_update(optimizer):
    """21 rows, micro-batches of 5 (shards of 3 + 2, the last micro-batch 1 + 0), 2 per step, with
    warmup, cosine, clipping and FedProx: the same weights, losses and progress calls as one process."""
    one, o1, s1, seen1 = _loop(1, optimizer, prox_mu=0.1)
    two, o2, s2, seen2 = _loop(2, optimizer, prox_mu=0.1)
    assert s1["steps"] == s2["steps"] == 3 and s1["micro_batches"] == s2["micro_batches"] == 5
    for key in ("loss_first", "loss_last", "loss_mean"):
        assert s2[key] == pytest.approx(s1[key], rel=1e-6)
    assert [m for m, _ in seen2] == [m for m, _ in seen1] and all(
        v2 == pytest.approx(v1, rel=1e-6) for (_, v1), (_, v2) in zip(seen1, seen2))
    moved = max(float((p - q).abs().max()) for p, q in zip(one.parameters(), _model(6).parameters()))
    assert moved > 1e-2 and _max_diff(one, two) < 1e-6 * max(1.0, moved) + 1e-7
    if optimizer == "galore":  # the record the method uploads: the same exact update
        u1, u2 = client_protocol.export_update(o1), client_protocol.export_update(o2)
        w0 = dict(_model(6).named_parameters())
        for name in u1:
            d1, d2 = u1[name].materialize(w0[name].detach()), u2[name].materialize(w0[name].detach())
            assert float((d1 - d2).abs().max()) < 1e-6
            assert [t.seed for t in u1[name].terms if hasattr(t, "seed")] == [t.seed for t in u2[name].terms if hasattr(t, "seed")]


def test_a_token_mean_loss_is_weighted_by_its_tokens_across_processes():
    """Shards with different numbers of valid tokens: the step's gradient is the mean over all of
    the step's tokens (not the mean of the shards' means, which DDP would take)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, 3, 6, generator=g)
    y = torch.randint(0, 3, (12, 3), generator=g)
    y[:4, 1:] = -100  # the first rows have fewer valid tokens: the shards are uneven in tokens
    one, _, s1, _ = _loop(1, "adamw", task=_TokenMean(), data=(x, y), batch_size=6, k=1)
    two, _, s2, _ = _loop(2, "adamw", task=_TokenMean(), data=(x, y), batch_size=6, k=1)
    assert s2["loss_mean"] == pytest.approx(s1["loss_mean"], rel=1e-6)
    assert _max_diff(one, two) < 1e-6


class _NanAtSecondRank(_Cls):
    def loss(self, model, batch):
        out = super().loss(model, batch)
        return out * float("nan") if int(batch["y"].shape[0]) == 2 else out  # only a 2-row shard (rank 1's)


def test_a_non_finite_loss_on_another_rank_stops_the_client_and_the_site_serves_the_next():
    with pytest.raises(ClientError, match="non-finite loss nan at local step 0"):
        _loop(2, "adamw", task=_NanAtSecondRank())
    two, *_ = _loop(2, "adamw")  # the helpers dropped the failed job and serve the next one
    one, *_ = _loop(1, "adamw")
    assert _max_diff(one, two) < 1e-6


def test_bad_settings_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"devices_per_client=0 must be an int >= 1"):
        tiny_cfg(tmp_path, train={"lr": 1e-2, "devices_per_client": 0})
    with pytest.raises(ConfigError, match=r"devices_per_client=2 with privacy.record"):
        tiny_cfg(tmp_path, train={"lr": 1e-2, "devices_per_client": 2},
                 privacy={"record": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}})


@pytest.mark.parametrize("method, options", [
    ("fedgalore", {"update_proj_gap": 2, "projector": "rsvd_then_random", "adaptive_proj_steps": 1}),
    ("fedit", {}),
])
def test_a_federation_with_two_processes_per_site_equals_one(tmp_path, method, options):
    """tiny_text (no dropout), 2 rounds of 3 sites: the global model, the losses and the bytes are one
    process's, to float rounding (FedGaLore's seeded bases and moments included)."""
    assert_federation_equals_one_process(tmp_path, method, options, devices_per_client=2)


def test_resume_with_two_processes_per_site(tmp_path):
    opts = {"update_proj_gap": 2, "projector": "rsvd_then_random", "adaptive_proj_steps": 1}
    train = {"lr": 1e-2, "batch_size": 16, "local_epochs": 1, "weight_decay": 0.01, "devices_per_client": 2}
    killed_and_resumed(tiny_cfg(tmp_path / "a", "fedgalore", rounds=4, method_options=opts, train=train),
                       tiny_cfg(tmp_path / "b", "fedgalore", rounds=4, method_options=opts, train=train))


class _FailsOnRankZero(_Cls):
    def loss(self, model, batch):
        if int(batch["y"].shape[0]) == 3:  # rank 0's shard of a 5-row micro-batch
            raise RuntimeError("out of memory on rank 0")
        return super().loss(model, batch)


def test_an_error_on_rank_zero_releases_the_helpers_and_the_site_serves_the_next():
    with pytest.raises(RuntimeError, match="out of memory on rank 0"):
        _loop(2, "adamw", task=_FailsOnRankZero())
    two, *_ = _loop(2, "adamw")  # the helpers met rank 0 in the step's all-reduce and dropped the job
    one, *_ = _loop(1, "adamw")
    assert _max_diff(one, two) < 1e-6
