"""federation.validation_fraction: a stratified hold-out of the training pool that no client
trains on, evaluated with the test set, for choosing hyperparameters off the test split."""
from __future__ import annotations

import json

import numpy as np
import pytest

import fedgalore
from fedgalore.job.config import ConfigError
from fedgalore.tasks.base import stratified_split, subset_examples

from fedgalore_testing.runs import tiny_cfg


def test_stratified_split_keeps_the_label_mix_and_is_seeded():
    labels = np.repeat([0, 1, 2], [50, 30, 20])
    rest, held = stratified_split(labels, 0.2, np.random.default_rng(3))
    assert sorted(np.concatenate([held, rest]).tolist()) == list(range(100))
    assert np.bincount(labels[held]).tolist() == [10, 6, 4]
    again = stratified_split(labels, 0.2, np.random.default_rng(3))[1]
    other = stratified_split(labels, 0.2, np.random.default_rng(4))[1]
    assert np.array_equal(held, again) and not np.array_equal(held, other)


def test_the_offline_tasks_split_as_before():
    """BBC News' and the vision tasks' train/test splits are this function with default_rng(seed)
    (the same permutations as their former private copies: recorded runs keep their data)."""
    labels = np.random.default_rng(0).integers(0, 5, 300)
    rng = np.random.default_rng(7)
    old_train, old_test = [], []
    for c in np.unique(labels):  # the former implementation, verbatim
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(0.2 * len(idx)))
        old_test.append(idx[:k])
        old_train.append(idx[k:])
    expected = (np.sort(np.concatenate(old_train)), np.sort(np.concatenate(old_test)))
    got = stratified_split(labels, 0.2, np.random.default_rng(7))
    assert np.array_equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])


def test_validation_examples_reach_no_client_and_are_evaluated(tmp_path):
    cfg = tiny_cfg(tmp_path, rounds=2, federation={"num_clients": 4, "clients_per_round": 2, "rounds": 2,
                                                  "validation_fraction": 0.25,
                                                  "partition": {"kind": "dirichlet", "alpha": 0.5, "min_size": 5}})
    res = fedgalore.run(cfg)
    from fedgalore.engine.runtime import Runtime

    rt = Runtime(cfg)
    val = set(rt.validation_idx.tolist())
    assert len(val) == 40  # 25 % of the 160 training examples
    assert all(not (set(p.tolist()) & val) for p in rt.parts)
    assert sum(len(p) for p in rt.parts) == 120
    assert len(subset_examples(rt.train_data, rt.validation_idx)) == 40
    assert "accuracy" in res.summary["final_validation"] and "accuracy" in res.summary["final"]
    assert all("eval/val_loss" in h for h in res.history)
    # the summary's test numbers are the test set's, not the validation set's
    assert res.summary["final"]["accuracy"] == res.history[-1]["eval/accuracy"]
    assert json.loads((res.run_dir / "summary.json").read_text())["final_validation"]["accuracy"] == res.history[-1]["eval/val_accuracy"]


def test_bad_validation_fraction_is_one_clear_line(tmp_path):
    with pytest.raises(ConfigError, match="validation_fraction"):
        tiny_cfg(tmp_path, federation={"num_clients": 4, "clients_per_round": 2, "validation_fraction": 1.0})
