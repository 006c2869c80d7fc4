"""Gradient accumulation in the shared local loop (train.grad_accum_steps; issue 18, part B).

k micro-batches of b examples must give one optimizer step on the batch of k·b examples, to float
rounding: same parameters after several AdamW steps with warmup, cosine decay and clipping, also
when the last step of a round is partial; for a token-mean loss the micro-batches are weighted by
their token counts (the task's ``loss_items``)."""
import pytest
import torch

from fedgalore.job.config import ConfigError, FederatedConfig
from fedgalore.federated.client import local_train, loss_items, optimizer_steps
from fedgalore.protocol.state import ClientContext
from fedgalore.protocol.train_config import TrainConfig
from fedgalore_testing.local import _Cls, _data, _model, _TokenMean


def _run(task, data, batch_size, k, rounds=1, scope="round", lr=5e-2):
    x, y = data
    model = _model(x.shape[-1])
    tc = TrainConfig(lr=lr, batch_size=batch_size, grad_accum_steps=k, warmup_ratio=0.25, schedule="cosine",
                     schedule_scope=scope, grad_clip=0.5, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    n = len(x)
    micro = -(-n // batch_size)
    stats = []
    for r in range(rounds):
        def batches():
            for i in range(0, n, batch_size):
                yield {"x": x[i : i + batch_size], "y": y[i : i + batch_size]}

        ctx = ClientContext(round=r, total_rounds=rounds, client=0, round_seed=0, num_examples=n, train=tc,
                            target_modules=[], head_params=[], loss_fn=task.loss, batches=batches,
                            steps=micro, steps_per_round=micro)
        stats.append(local_train(model, opt, ctx))
    return model, stats


def _max_diff(a, b):
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("scope", ["round", "global"])
def test_k_micro_batches_equal_one_batch_k_times_larger(scope):
    data = _data(n=20)
    big, s_big = _run(_Cls(), data, batch_size=8, k=1, rounds=2, scope=scope)  # steps of 8, 8, 4 examples
    acc, s_acc = _run(_Cls(), data, batch_size=2, k=4, rounds=2, scope=scope)  # 4, 4, 2 micro-batches of 2
    assert [s["steps"] for s in s_acc] == [s["steps"] for s in s_big] == [3, 3]
    assert s_acc[0]["micro_batches"] == 10 and "micro_batches" not in s_big[0]
    for a, b in zip(s_acc, s_big):
        for key in ("loss_first", "loss_last", "loss_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6)
    assert _max_diff(acc, big) < 1e-6
    # and the run moved: accumulation is not a no-op
    assert _max_diff(acc, _model()) > 1e-2


def test_token_mean_loss_weights_micro_batches_by_tokens():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 5, 6, generator=g)
    y = torch.randint(0, 3, (8, 5), generator=g)
    mask = torch.rand(8, 5, generator=g) < 0.6  # uneven valid-token counts per sequence
    mask[:, 0] = True
    y = torch.where(mask, y, torch.full_like(y, -100))
    task = _TokenMean()
    big, s_big = _run(task, (x, y), batch_size=8, k=1)
    acc, s_acc = _run(task, (x, y), batch_size=2, k=4)
    assert s_acc[0]["steps"] == s_big[0]["steps"] == 1
    assert s_acc[0]["loss_first"] == pytest.approx(s_big[0]["loss_first"], rel=1e-6)
    assert _max_diff(acc, big) < 1e-6
    # weighting by rows instead would be a different (wrong) gradient: the check above means something
    class _Rows(_TokenMean):
        loss_items = None
    rows, _ = _run(_Rows(), (x, y), batch_size=2, k=4)
    assert _max_diff(rows, big) > 1e-4


def test_helpers():
    assert optimizer_steps(10, 4) == 3 and optimizer_steps(8, 4) == 2 and optimizer_steps(5, 1) == 5 and optimizer_steps(0, 32) == 0
    assert loss_items(_Cls().loss, {"x": torch.zeros(5, 2)}) == 5
    assert loss_items(_TokenMean().loss, {"y": torch.tensor([[1, -100], [2, 3]])}) == 3


def test_config_field_and_validation():
    assert TrainConfig().grad_accum_steps == 1
    cfg = FederatedConfig.from_dict({"train": {"batch_size": 2, "grad_accum_steps": 32}})
    assert cfg.train.grad_accum_steps == 32
    with pytest.raises(ConfigError, match="grad_accum_steps=0 must be >= 1"):
        FederatedConfig.from_dict({"train": {"grad_accum_steps": 0}})
    # T = train.local_steps counts optimizer steps: the client draws T·k micro-batches
    from fedgalore.engine.runtime import Runtime

    both = FederatedConfig.from_dict({"train": {"grad_accum_steps": 4, "local_steps": 10, "batch_size": 2}})
    assert Runtime._steps_for(100, both.train) == 40


def test_llama_pipeline_uses_the_papers_batch():
    """Appendix H, Table 8: per-device batch 2, 32 accumulation steps (effective 64)."""
    from fedgalore.cli import _load_config  # the pipeline carries a compare: section

    cfg, _ = _load_config("conf/pipeline/metamath_llama2.yaml", [])
    assert (cfg.train.batch_size, cfg.train.grad_accum_steps) == (2, 32)
    assert cfg.train.lr == 1e-4 and cfg.train.warmup_ratio == 0.03 and cfg.federation.rounds == 20


def test_causal_lm_loss_items_are_the_tokens_its_mean_runs_over():
    """CausalLMTask.loss_items counts the shifted response tokens, so weighting micro-batch losses
    by it reproduces the loss of the whole batch (HF's token-mean causal LM loss)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fedgalore.tasks.paper_math.base import CausalLMTask

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)).eval()
    ids = torch.randint(0, 50, (2, 12))
    labels = ids.clone()
    labels[0, :9] = -100  # short response
    labels[1, :3] = -100  # long response
    mask = torch.ones_like(ids)

    def loss(rows):
        b = {"input_ids": ids[rows], "attention_mask": mask[rows], "labels": labels[rows]}
        return float(model(**b).loss), CausalLMTask.loss_items(None, b)

    full, n = loss([0, 1])
    (l0, n0), (l1, n1) = loss([0]), loss([1])
    assert (n0, n1, n) == (3, 9, 12)
    assert full == pytest.approx((l0 * n0 + l1 * n1) / (n0 + n1), rel=1e-5)
    assert full != pytest.approx((l0 + l1) / 2, rel=1e-3)  # row weighting would be wrong
