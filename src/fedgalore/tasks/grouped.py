"""Per-example outputs: what lets one batched pass score many groups (sites) of examples.

A task's ``evaluate(model, examples)`` scores one set. Per-site evaluation (``federation.client_eval``,
``fedgalore evaluate --by COLUMN``) scores many small sets; evaluated one by one they cost a loop of
short, partly filled batches each. :meth:`fedgalore.tasks.base.Task.evaluate_groups` instead runs
the model once over the union of the groups (:meth:`~fedgalore.tasks.base.Task.example_outputs`:
one record per example — prediction, gold label, loss, ...) and computes each group's metrics from
its slice of those records (:meth:`~fedgalore.tasks.base.Task.metrics_of_outputs`). Every metric
is a function of per-example quantities, so each group's metrics equal those of evaluating the
group alone (up to float rounding of the loss: a mean of per-example losses instead of a
batch-size-weighted mean of batch means).

:func:`classifier_outputs` is that pass for the classifiers (text, image, ``tiny_text``): logits,
predicted class (or score), gold label and the per-example loss — cross-entropy, or the squared
error of a regression — as the Hugging Face model computes them. Rows with an attention mask go
longest first, so each batch is trimmed to less padding (masked positions do not change logits).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

__all__ = ["classifier_outputs", "slice_outputs", "accuracy_of", "macro_f1_of", "GroupOutputs"]

#: one array per field, one entry per example (``pred``, ``gold``, ``loss``, ``logits``, ...)
GroupOutputs = dict[str, np.ndarray]


def _lengths(examples: Any) -> np.ndarray | None:
    cols = getattr(examples, "columns", None)
    if isinstance(cols, dict) and "attention_mask" in cols and cols["attention_mask"].dim() == 2:
        return cols["attention_mask"].sum(1).numpy()
    return None


@torch.no_grad()
def classifier_outputs(model: nn.Module, examples: Any, batch_size: int, *, regression: bool = False,
                       collate: Callable[[Sequence[Any]], dict[str, torch.Tensor]] | None = None,
                       on_batch: Callable[[int, int], None] | None = None) -> GroupOutputs:
    """``{"logits", "pred", "gold", "loss"}`` of a sequence / image classifier on ``examples``
    (batches of ``batch_size``; ``examples.batch(idx)``, else ``collate`` of the items): ``logits``
    (n × K, float32), ``pred`` (argmax class id; the score for a ``regression``), ``gold``
    (``labels``), ``loss`` (per-example cross-entropy, or squared error). ``on_batch(k, n)``:
    called after every batch with its size and the number of examples (a progress bar)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    n = len(examples)
    lengths = _lengths(examples)
    order = np.argsort(-lengths, kind="stable") if lengths is not None else np.arange(n)
    logits_all: np.ndarray | None = None
    gold = np.zeros(n, dtype=np.float32 if regression else np.int64)
    loss = np.zeros(n, dtype=np.float64)
    try:
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            batch = examples.batch(idx) if hasattr(examples, "batch") else collate([examples[int(i)] for i in idx])
            labels = batch["labels"]
            logits = model(**{k: v.to(device) for k, v in batch.items() if k != "labels"}).logits.float().cpu()
            if logits_all is None:
                logits_all = np.zeros((n, logits.shape[-1]), dtype=np.float32)
            logits_all[idx] = logits.numpy()
            if regression:
                err = (logits[:, 0] - labels.float()) ** 2
            else:
                err = nn.functional.cross_entropy(logits, labels.long(), reduction="none")
            loss[idx] = err.double().numpy()
            gold[idx] = labels.numpy()
            if on_batch is not None:
                on_batch(len(idx), n)
    finally:
        model.train(was_training)
    if logits_all is None:
        logits_all = np.zeros((0, 1), dtype=np.float32)
    pred = logits_all[:, 0] if regression else logits_all.argmax(-1)
    return {"logits": logits_all, "pred": pred, "gold": gold, "loss": loss}


def accuracy_of(pred: np.ndarray, gold: np.ndarray) -> float:
    """:func:`fedgalore.tasks.metrics.accuracy` without scikit-learn's input checks (milliseconds
    per call, which 200 sites pay 200 times): the same float, ``mean(pred == gold)``; 0 for no examples."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    return float(np.mean(pred == gold)) if len(gold) else 0.0


def macro_f1_of(pred: np.ndarray, gold: np.ndarray) -> float:
    """:func:`fedgalore.tasks.metrics.macro_f1` without scikit-learn's input checks, computed as
    scikit-learn computes it — per class ``c`` present in ``gold``, ``2·TP_c / (|gold = c| +
    |pred = c|)``, then their mean — so the same float (tests/tasks/test_site_eval.py)."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    if not len(gold):
        return 0.0
    classes = np.unique(gold)
    tp = np.array([np.count_nonzero((gold == c) & (pred == c)) for c in classes], dtype=np.int64)
    true_sum = np.array([np.count_nonzero(gold == c) for c in classes], dtype=np.int64)
    pred_sum = np.array([np.count_nonzero(pred == c) for c in classes], dtype=np.int64)
    return float(np.mean((1 + 1.0) * tp.astype(np.float64) / (1.0 * true_sum.astype(np.float64) + pred_sum.astype(np.float64))))


def slice_outputs(outputs: GroupOutputs, start: int, stop: int) -> GroupOutputs:
    """The records of examples ``start .. stop-1`` (every field sliced alike)."""
    return {k: v[start:stop] for k, v in outputs.items()}
