"""Per-client evaluation (``federation.client_eval``): the global model on each client's held-out share.

A real federation judges a model by its worst site as much as by a pooled test set. With
``client_eval: true`` every client's share is split before training into its training part and a
held-out part of ``client_test_fraction`` (:func:`fedgalore.job.clients.split_clients`), and
every evaluation round the server evaluates the global model on each held-out part with the
task's own ``evaluate``. The round's ``metrics.jsonl`` record gets

* ``eval/client_mean_<m>`` for every metric ``m``: the example-weighted mean
  ``Σ_j n_j m_j / Σ_j n_j`` of the clients' values (``n_j``: client ``j``'s held-out examples) —
  for accuracy the pooled accuracy; for a non-additive metric (macro-F1) the mean of the clients'
  values, not the metric of the pooled predictions;
* for the primary metric ``p``: ``eval/client_worst_<p>`` (the lowest value, or the highest when
  lower is better), ``eval/client_std_<p>`` (the population standard deviation of the clients'
  values, unweighted: the spread across sites) and ``eval/client_range_<p>`` (max − min);
* ``client_eval``: ``{"worst_client": name, "clients": {name: {"n": n_j, <metric>: value}}}``.

Cost: one batched forward pass over the union of the held-out parts (``client_test_fraction`` of
the training set), split by client afterwards (:meth:`fedgalore.tasks.base.Task.evaluate_groups`:
full batches spanning clients, each client's metrics computed from its examples' records — equal
to evaluating the client alone), every ``federation.client_eval_every`` rounds (default: with
every evaluation; ``benchmarks/client_eval_pass.py`` measures it against a pooled evaluation of
the same rows). A task of one's own without per-example records is evaluated client by client.
It runs on the server, like the pooled evaluation, for every backend (sequential, Ray, Flower):
the server's runtime holds each client's held-out indices, and the workers train on the training
parts only (the parts they are sent).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from torch import nn

from fedgalore.job.clients import Clients
from fedgalore.tasks.base import Task

__all__ = ["evaluate_clients", "summarize_clients"]


def evaluate_clients(task: Task, model: nn.Module, train_data: Sequence[Any], clients: Clients,
                     batch_size: int) -> dict[str, dict[str, float]]:
    """``{client name: {"n": held-out examples, metric: value, ...}}`` of ``model`` on every
    client's held-out part (``clients.test_parts``; with per-site data each site's own test
    rows, ``clients.test_split``)."""
    data = task.test_set() if clients.test_split else train_data
    parts = list(clients.test_parts or [])
    per = task.evaluate_groups(model, data, parts, batch_size) if parts else []
    return {clients.name(j): {"n": int(len(idx)), **{k: float(v) for k, v in metrics.items()}}
            for j, (idx, metrics) in enumerate(zip(parts, per))}


def summarize_clients(per_client: dict[str, dict[str, float]], primary: str,
                      higher_is_better: bool) -> tuple[dict[str, float], str]:
    """The scalar summaries of :func:`evaluate_clients`' result (module doc: weighted means,
    worst, std, range; keys without the ``eval/`` prefix) and the worst client's name."""
    names = list(per_client)
    n = np.array([per_client[c]["n"] for c in names], dtype=np.float64)
    keys = [k for k in per_client[names[0]] if k != "n" and all(k in per_client[c] for c in names)]
    out = {f"client_mean_{k}": float(np.dot(n, [per_client[c][k] for c in names]) / n.sum()) for k in keys}
    values = np.array([per_client[c][primary] for c in names], dtype=np.float64)
    worst = int(np.argmin(values) if higher_is_better else np.argmax(values))
    out.update({f"client_worst_{primary}": float(values[worst]), f"client_std_{primary}": float(values.std()),
                f"client_range_{primary}": float(values.max() - values.min())})
    return out, names[worst]
