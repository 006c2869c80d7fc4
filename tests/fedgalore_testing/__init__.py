"""Shared helpers of the test suite (importable from every folder of tests/: pyproject.toml's
``pythonpath = ["tests"]``). A test file imports what it needs from here, never from another test file.

* this module: the repository root and the newcomer's tiny budgets for the shipped pipelines;
* :mod:`fedgalore_testing.runs`: tiny federated configs, a killed-and-resumed run, state comparisons;
* :mod:`fedgalore_testing.cmdline`: the ``fedgalore`` command in and out of process;
* :mod:`fedgalore_testing.docs`: the documentation's code blocks and how each command is tested;
* :mod:`fedgalore_testing.reports`: run directories written by hand, markdown table rows;
* :mod:`fedgalore_testing.models`: a finished run's global model and logits, generic-task inputs;
* :mod:`fedgalore_testing.local`: toy models and one client's local loop (accumulation, data parallel);
* :mod:`fedgalore_testing.flower`: an in-process Flower Grid;
* :mod:`fedgalore_testing.assets`: tiny random checkpoints and data files (conftest.py's fixtures).
"""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


TINY_TEXT = ["task.options.limit=80", "task.options.max_length=16", "federation.num_clients=4",
             "federation.clients_per_round=2", "federation.partition.min_size=2", "train.local_steps=1"]


TINY_PAPER = ["task.name=tiny_text", "task.options={}", "task.options.n_train=48", "task.options.n_test=16",
              "task.options.hidden_size=16", "task.options.num_layers=1", "device=cpu", "method.rank=4",
              "federation.num_clients=3", "federation.clients_per_round=2", "federation.partition.min_size=2",
              "federation.rounds=1", "train.local_steps=1", "train.batch_size=16"]


def minilm_or_skip() -> None:
    from fedgalore.tasks import assets

    try:
        assets.minilm_path(), assets.bbc_news_dir()
    except assets.AssetError as exc:
        pytest.skip(f"offline text assets not installed: {exc}")
