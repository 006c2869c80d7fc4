"""Toy models and tasks for one client's local loop, and that loop run with one or several processes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fedgalore
from fedgalore.federated.client import local_train
from fedgalore.optim import GaLoreAdamW, client_protocol
from fedgalore.protocol.state import ClientContext
from fedgalore.protocol.train_config import TrainConfig
from fedgalore_testing.runs import tiny_cfg


def _data(n=20, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g)


class _Cls:
    """Per-example mean cross-entropy (rows weight the micro-batches)."""

    def loss(self, model, batch):
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


class _TokenMean:
    """A loss averaged over valid tokens (label ≠ −100), like a causal LM's response-only loss."""

    def loss(self, model, batch):
        logits = model(batch["x"])  # (B, T, C)
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten(), ignore_index=-100)

    def loss_items(self, batch):
        return int((batch["y"] != -100).sum())


def _model(d=6, c=3, seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, c))  # no dropout


def _loop(devices: int, optimizer: str, *, task=None, data=None, batch_size=5, k=2, prox_mu=0.0, shard=False, model=None):
    """One client's local training (``shard``: a sharded site, tests/federated/test_sharded_site.py)."""
    x, y = data if data is not None else _data(n=21)
    model = model if model is not None else _model(x.shape[-1])
    tc = TrainConfig(lr=5e-2, batch_size=batch_size, grad_accum_steps=k, warmup_ratio=0.25, grad_clip=0.5,
                     weight_decay=0.01, devices_per_client=devices, prox_mu=prox_mu, shard_params=shard and devices > 1)
    if optimizer == "galore":
        mats = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
        rest = [(n, p) for n, p in model.named_parameters() if p.dim() != 2]
        opt = GaLoreAdamW([{"params": mats, "rank": 2, "projector": "rsvd_then_random", "update_proj_gap": 2},
                           {"params": rest}], lr=tc.lr, weight_decay=tc.weight_decay)
        client_protocol.mark(opt)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    n = len(x)

    def batches():
        for i in range(0, n, batch_size):
            yield {"x": x[i:i + batch_size], "y": y[i:i + batch_size]}

    micro = -(-n // batch_size)
    seen: list[tuple[int, float]] = []
    ctx = ClientContext(round=0, total_rounds=1, client=0, round_seed=3, num_examples=n, train=tc, target_modules=[],
                        head_params=[], loss_fn=(task or _Cls()).loss, batches=batches, steps=micro, steps_per_round=micro,
                        on_step=lambda m, v: seen.append((m, v)))
    stats = local_train(model, opt, ctx)
    return model, opt, stats, seen


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def _final(res) -> dict:
    from fedgalore.federated.checkpoint import load_latest_checkpoint

    state, _ = load_latest_checkpoint(res.run_dir)
    return state.params


def assert_federation_equals_one_process(tmp_path, method: str, options: dict, **site) -> None:
    """2 rounds of 3 tiny_text sites trained with the ``train`` settings ``site`` against one process:
    the same global model, losses and bytes, to float rounding (also tests/federated/test_sharded_site.py)."""
    train = {"lr": 1e-2, "batch_size": 7, "local_epochs": 1, "weight_decay": 0.01, "grad_accum_steps": 2}
    one = fedgalore.run(tiny_cfg(tmp_path / "one", method, rounds=2, method_options=options, train=train))
    two = fedgalore.run(tiny_cfg(tmp_path / "two", method, rounds=2, method_options=options, train={**train, **site}))
    p1, p2 = _final(one), _final(two)
    assert sorted(p1) == sorted(p2)
    assert max(float((p1[k] - p2[k]).abs().max()) for k in p1) < 1e-5
    for h1, h2 in zip(one.history, two.history):
        assert h2["train_loss"] == pytest.approx(h1["train_loss"], rel=1e-5)
    assert two.summary["final"]["accuracy"] == pytest.approx(one.summary["final"]["accuracy"], abs=1 / 64 + 1e-9)
    assert two.summary["bytes_up_total"] == one.summary["bytes_up_total"]
