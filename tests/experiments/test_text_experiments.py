"""Issue-8 experiments that train on a real task outside the round loop (App. E projector
schedules, Fig. 3c linear connectivity), on the tiny task."""
from __future__ import annotations

import math

import pytest
import torch


TINY = {"n_train": 64, "n_test": 24, "hidden_size": 16, "num_layers": 1, "seq_len": 8}


def test_barrier_formula() -> None:
    from fedgalore.experiments.linear_connectivity import barrier

    lams = [0.0, 0.25, 0.5, 0.75, 1.0]
    assert barrier(lams, [1.0, 1.5, 2.0, 1.5, 1.0]) == pytest.approx(1.0)  # bump of 1 above a flat chord
    # chord from 1 to 3: values 1.5, 2.0, 2.5; L = 1.2, 2.1, 2.0 -> excesses -0.3, 0.1, -0.5
    assert barrier(lams, [1.0, 1.2, 2.1, 2.0, 3.0]) == pytest.approx(0.1)
    assert barrier(lams, [2.0, 1.0, 0.5, 1.0, 2.0]) == pytest.approx(-1.0)  # below the chord: signed, not clipped


def test_projector_schedules_same_start_same_batches() -> None:
    from fedgalore.experiments.projector_schedules import Config, run

    cfg = Config(task="tiny_text", task_options=TINY, steps=4, tau=2, rank=2, seeds=(0,), eval_examples=8, shards=2, alpha=10.0)
    before = torch.random.get_rng_state()
    res = run(cfg)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's global RNG is left alone
    assert run(cfg)["runs"][0]["loss"] == res["runs"][0]["loss"]  # and the study is reproducible
    runs = {r["variant"]: r for r in res["runs"]}
    assert set(runs) == {"rsvd_then_random", "svd", "rsvd", "random"}
    first = {v: r["loss"][0] for v, r in runs.items()}
    assert max(first.values()) - min(first.values()) < 1e-6  # same start, same first batch
    assert runs["svd"]["loss"][1:] != runs["random"]["loss"][1:]  # only the projector differs, and it matters
    for r in runs.values():
        assert len(r["loss"]) == 4 and all(math.isfinite(x) for x in r["loss"])
        assert all(b > a for a, b in zip(r["cum_cpu"], r["cum_cpu"][1:]))
        assert r["cpu_total"] == pytest.approx(r["cum_cpu"][-1])
    assert res["summary"]["svd"]["cpu_total_vs_svd"] == pytest.approx(1.0)


def test_linear_connectivity_endpoints_and_merged_lora_agree() -> None:
    """The line's endpoints are the two clients; the merged-weight LoRA line starts and ends at the
    same functions as the factor line (W0 + s·BA reproduces the adapter model exactly)."""
    from fedgalore.experiments.linear_connectivity import Config, run

    cfg = Config(task="tiny_text", task_options=TINY, rank=2, examples_per_client=16, epochs=1, batch_size=8,
                 lrs=(1e-2,), seeds=(0,), points=3, eval_examples=16)
    before = torch.random.get_rng_state()
    res = run(cfg)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's global RNG is left alone
    by = {r["method"]: r for r in res["results"]}
    assert set(by) == {"full", "galore", "lora", "lora_merged"}
    for a, b in ((0, 0), (-1, -1)):
        assert by["lora_merged"]["loss"][a] == pytest.approx(by["lora"]["loss"][b], abs=1e-5)
    for r in by.values():
        assert r["lambdas"] == [0.0, 0.5, 1.0]
        chord_mid = 0.5 * (r["loss"][0] + r["loss"][-1])
        assert r["barrier"] == pytest.approx(r["loss"][1] - chord_mid)
    assert by["full"]["distance"] > 0 and by["galore"]["distance"] > 0


def test_head_spreads_over_a_label_sorted_set() -> None:
    """Held-out subsets must cover every class even when the test set is sorted by label."""
    import torch

    from fedgalore.experiments._common import head
    from fedgalore.tasks.base import ArrayDataset

    ds = ArrayDataset({"labels": torch.arange(5).repeat_interleave(20), "x": torch.arange(100)})
    sub = head(ds, 25)
    assert isinstance(sub, ArrayDataset) and len(sub) == 25
    assert torch.bincount(sub.columns["labels"]).tolist() == [5, 5, 5, 5, 5]
    assert sub.columns["x"][0] == 0 and sub.columns["x"][-1] == 99
    assert len(head(ds, 1000)) == 100 and [e for e in head(list(range(10)), 3)] == [0, 4, 9]
