"""Shared pieces of the experiments that train on a real task outside the federated loop."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from fedgalore.tasks import get_task
from fedgalore.tasks.base import Task, head_parameters, resolve_target_modules

__all__ = ["Prepared", "prepare_task", "batches", "head", "mean_loss", "params_by_name"]


@dataclass
class Prepared:
    task: Task
    targets: list[str]  # adapted nn.Linear modules (their .weight is W)
    heads: list[str]  # head parameters every method trains fully


def prepare_task(name: str, **options: Any) -> Prepared:
    """The task plus the module names the federated runtime adapts (same rule as the engine)."""
    task = get_task(name, **options)
    model = task.build_model()
    targets = resolve_target_modules(model, task.target_modules, exclude=task.head_modules)
    return Prepared(task, targets, head_parameters(model, task.head_modules))


def batches(task: Task, indices: Sequence[int], batch_size: int, steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` mini-batches drawn epoch by epoch (fresh permutation per epoch) from ``indices``."""
    rng = np.random.default_rng(seed)
    data = task.train_set()
    idx = np.asarray(indices)
    order: list[int] = []
    while len(order) < steps * batch_size:
        order.extend(int(i) for i in idx[rng.permutation(len(idx))])
    return [task.collate([data[i] for i in order[s * batch_size:(s + 1) * batch_size]]) for s in range(steps)]


def head(examples: Sequence[Any], n: int) -> Sequence[Any]:
    """``n`` examples spread evenly over the set (not the first ``n``: test sets may be sorted by
    label), keeping the dataset type (tasks batch their own datasets faster)."""
    from fedgalore.tasks.base import ArrayDataset

    total = len(examples)
    idx = np.unique(np.linspace(0, total - 1, num=min(n, total)).round().astype(int)) if total else np.zeros(0, dtype=int)
    if isinstance(examples, ArrayDataset):
        t = torch.as_tensor(idx, dtype=torch.long)
        return type(examples)({k: v[t] for k, v in examples.columns.items()})
    return [examples[int(i)] for i in idx]


@torch.no_grad()
def mean_loss(task: Task, model: nn.Module, examples: Sequence[Any], batch_size: int = 64) -> float:
    """Example-weighted mean of ``task.loss`` over ``examples`` (eval mode)."""
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(examples), batch_size):
        chunk = [examples[j] for j in range(i, min(i + batch_size, len(examples)))]
        total += float(task.loss(model, task.collate(chunk))) * len(chunk)
        n += len(chunk)
    model.train()
    return total / max(n, 1)


def params_by_name(model: nn.Module, names: Sequence[str]) -> list[tuple[str, nn.Parameter]]:
    params = dict(model.named_parameters())
    return [(n, params[n]) for n in names]
