"""Per-site evaluation in one pass (issue 44): ``Task.evaluate_groups`` runs the model once over the
union of the groups and splits the records by group; every group's metrics equal evaluating that
group alone — for each task family (tiny_text, text / image classification, causal LM) — and the
round loop's per-client metrics (``federation.client_eval``, ``client_eval_every``) are those."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

import fedgalore
from fedgalore.job.config import ConfigError
from fedgalore.jsonl import read_jsonl
from fedgalore.tasks import get_task
from fedgalore.tasks.base import subset_examples
from fedgalore_testing.runs import tiny_cfg  # noqa: E402
from fedgalore_testing.assets import news_rows, write  # noqa: E402


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))


def _groups(n: int, k: int, seed: int = 0) -> list[np.ndarray]:
    """``k`` disjoint groups of uneven sizes over a shuffled ``range(n)`` (every group non-empty)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(n)
    cuts = np.sort(rng.choice(np.arange(1, n), k - 1, replace=False))
    return [np.sort(g) for g in np.split(perm, cuts)]


def _assert_same(grouped: list[dict], alone: list[dict], loss_rel: float = 1e-5) -> None:
    assert len(grouped) == len(alone)
    for g, a in zip(grouped, alone):
        assert list(g) == list(a)  # the same metrics, in the same order
        for key in a:
            if "loss" in key or key == "perplexity":
                assert g[key] == pytest.approx(a[key], rel=loss_rel, abs=1e-7), key
            else:
                assert g[key] == a[key], key  # counts of hits: exactly equal


def _each_alone(task, model, data, groups, batch_size):
    return [task.evaluate(model, subset_examples(data, g), batch_size) for g in groups]


def test_tiny_text_groups_equal_each_group_alone():
    task = get_task("tiny_text", n_train=200, n_test=8)
    model = task.build_model()
    data = task.train_set()
    groups = _groups(len(data), 23)
    grouped = task.evaluate_groups(model, data, groups, 16)
    _assert_same(grouped, _each_alone(task, model, data, groups, 16))
    assert len({round(m["accuracy"], 6) for m in grouped}) > 1  # the groups differ: a real check


def test_text_classification_groups_equal_alone_with_padding(tmp_path, bert_dir):
    """Texts of different lengths (batches trimmed to their longest row; the pass goes longest
    first): the metrics per group still equal each group's own evaluation."""
    df = news_rows(90)
    df["body"] = [b + " news" * (i % 7) for i, b in enumerate(df["body"])]
    task = get_task("text_classification", model=str(bert_dir), data=str(write(df, tmp_path / "news.csv")),
                    text_column="body", label_column="topic", max_length=24)
    model = task.build_model()
    data = task.train_set()
    lengths = data.columns["attention_mask"].sum(1)
    assert int(lengths.max()) > int(lengths.min())
    groups = _groups(len(data), 9, seed=1)
    _assert_same(task.evaluate_groups(model, data, groups, 8), _each_alone(task, model, data, groups, 8))


def test_image_classification_groups_equal_alone(tmp_path, vit_dir):
    from fedgalore_testing.models import _images

    task = get_task("image_classification", model=str(vit_dir), data=str(_images(tmp_path / "pets", per_class=8)),
                    test_fraction=0.25, new_head=True)
    model = task.build_model()
    data = task.train_set()
    groups = _groups(len(data), 5, seed=2)
    _assert_same(task.evaluate_groups(model, data, groups, 4), _each_alone(task, model, data, groups, 4))


def test_causal_lm_groups_equal_alone(tmp_path, llama_dir, monkeypatch):
    """The token-weighted loss per group, and exact match per kind (generation stubbed to a fixed
    answer per prompt, so it does not depend on the batch)."""
    from fedgalore_testing.models import QA, causal_task

    path = write(pd.DataFrame(QA * 2), tmp_path / "qa.jsonl")
    plain = causal_task(llama_dir, path, test_fraction=0.5)
    model = plain.build_model()
    data = plain.test_set()
    groups = _groups(len(data), 4, seed=3)
    _assert_same(plain.evaluate_groups(model, data, groups, 3), _each_alone(plain, model, data, groups, 3))

    task = causal_task(llama_dir, path, test_fraction=0.5, answer_pattern=r"answer is\s*(-?[\d,.]+)")
    answers = {p: (f"the answer is {a}" if i % 3 else "no idea") for i, (p, a) in enumerate(zip(task.test_set().prompts,
                                                                                             task.test_set().answers))}
    monkeypatch.setattr(task, "generate", lambda m, prompts, max_new_tokens=None: [answers[p] for p in prompts])
    data = task.test_set()
    grouped = task.evaluate_groups(model, data, groups, 3)
    _assert_same(grouped, _each_alone(task, model, data, groups, 3))
    assert {"exact_match", "loss", "perplexity"} <= set(grouped[0])
    assert grouped[0]["perplexity"] == pytest.approx(math.exp(grouped[0]["loss"]))


def test_a_task_without_per_example_records_is_evaluated_group_by_group():
    """A task of one's own (only ``evaluate``) still gets per-group metrics: one call per group."""
    from fedgalore.tasks.synthetic import TinyTextTask

    calls = []

    class Mine(TinyTextTask):
        example_outputs = fedgalore.tasks.base.Task.example_outputs

        def evaluate(self, model, examples, batch_size):
            calls.append(len(examples))
            return super().evaluate(model, examples, batch_size)

    task = Mine(n_train=60, n_test=4)
    groups = _groups(60, 4)
    out = task.evaluate_groups(task.build_model(), task.train_set(), groups, 16)
    assert calls == [len(g) for g in groups] and len(out) == 4

    class OwnMetric(TinyTextTask):  # evaluate() overridden, per-example records inherited: not used for it
        def evaluate(self, model, examples, batch_size):
            calls.append(-len(examples))
            return {"accuracy": 1.0, "loss": 0.0}

    calls.clear()
    mine = OwnMetric(n_train=60, n_test=4)
    assert mine.evaluate_groups(mine.build_model(), mine.train_set(), groups, 16) == [{"accuracy": 1.0, "loss": 0.0}] * 4
    assert calls == [-len(g) for g in groups]


# ----------------------------------------------------------------------------- the round loop
def test_client_eval_uses_one_pass_and_matches_per_client_evaluation(tmp_path, monkeypatch):
    """A run with ``client_eval``: each client's metrics in metrics.jsonl equal evaluating the final
    global model on that client's held-out rows alone, and the loop ran the model once over their
    union (one ``example_outputs`` call per evaluation, no per-client ``evaluate``)."""
    from fedgalore.trained.global_model import load_global_model
    from fedgalore.tasks.synthetic import TinyTextTask

    passes = []
    real = TinyTextTask.example_outputs
    monkeypatch.setattr(TinyTextTask, "example_outputs", lambda self, m, ex, bs: passes.append(len(ex)) or real(self, m, ex, bs))
    cfg = tiny_cfg(tmp_path, "fedavg_full", rounds=2)
    cfg.federation.client_eval = True
    cfg.federation.client_test_fraction = 0.3
    res = fedgalore.run(cfg)
    history = read_jsonl(res.run_dir / "metrics.jsonl")
    held = sum(json.loads((res.run_dir / "partition.json").read_text())["test_sizes"])
    assert passes == [held, held]  # one pass over the union per evaluation round
    g = load_global_model(res.run_dir)
    clients = g.runtime.clients
    per = history[-1]["client_eval"]["clients"]
    for j, idx in enumerate(clients.test_parts):
        alone = g.task.evaluate(g.model, subset_examples(g.runtime.train_data, idx), cfg.federation.eval_batch_size)
        got = per[clients.name(j)]
        assert got["n"] == len(idx) and got["accuracy"] == alone["accuracy"]
        assert got["loss"] == pytest.approx(alone["loss"], rel=1e-5)


def test_client_eval_every_sets_its_own_schedule(tmp_path):
    cfg = tiny_cfg(tmp_path, "fedavg_full", rounds=5)
    cfg.federation.client_eval = True
    cfg.federation.client_test_fraction = 0.3
    cfg.federation.client_eval_every = 2
    res = fedgalore.run(cfg)
    history = read_jsonl(res.run_dir / "metrics.jsonl")
    assert [r["round"] for r in history if "client_eval" in r] == [2, 4, 5]  # every 2 rounds and the last
    assert all("eval/accuracy" in r for r in history)  # the pooled evaluation still every round (eval_every=1)
    assert res.summary["final"]["accuracy"] == history[-1]["eval/accuracy"]

    cfg2 = tiny_cfg(tmp_path / "b", "fedavg_full", rounds=4)
    cfg2.federation.client_eval = True
    cfg2.federation.client_test_fraction = 0.3
    cfg2.federation.eval_every = 3
    cfg2.federation.client_eval_every = 1  # more often than the pooled evaluation
    history = read_jsonl(fedgalore.run(cfg2).run_dir / "metrics.jsonl")
    assert [r["round"] for r in history if "client_eval" in r] == [1, 2, 3, 4]
    assert [r["round"] for r in history if "eval/accuracy" in r] == [3, 4]
    with pytest.raises(ConfigError, match=r"federation.client_eval_every=0 must be >= 1"):
        fedgalore.load_config(None, ["federation.client_eval_every=0"])


def test_the_fast_group_metrics_are_scikit_learns_floats():
    """accuracy_of / macro_f1_of (no input checks: 200 sites would pay them 200 times) return
    exactly what the task metrics (scikit-learn) return, on random labels of every shape."""
    from fedgalore.tasks.grouped import accuracy_of, macro_f1_of
    from fedgalore.tasks.metrics import accuracy, macro_f1

    rng = np.random.default_rng(0)
    for trial in range(300):
        n, k = int(rng.integers(0, 40)), int(rng.integers(1, 7))
        gold, pred = rng.integers(0, k, n), rng.integers(0, k + 1, n)  # pred may name a class gold lacks
        assert accuracy_of(pred, gold) == accuracy(pred, gold)
        assert macro_f1_of(pred, gold) == macro_f1(pred, gold)
