"""Evaluation metrics (GLUE conventions): accuracy, macro-F1, binary F1, Matthews correlation,
Pearson / Spearman correlation and mean squared error.

Accuracy and macro-F1 are computed with numpy (checked equal to scikit-learn's); the others are
thin wrappers around the reference implementations users trust — scikit-learn (``f1_score``,
``matthews_corrcoef``, ``mean_squared_error``) and SciPy (``pearsonr``, ``spearmanr``) — fixing the conventions the federated evaluation needs:

* empty inputs give 0.0 (an evaluation on no examples reports nothing, never NaN);
* macro-F1 averages over the classes present in the gold labels (a class the model predicts
  but the test set lacks does not dilute the mean), with F1 = 0 for a class never predicted;
* binary F1 of a positive class absent from both predictions and gold is 0;
* Matthews correlation is 0 when undefined (constant predictions), as scikit-learn returns;
* Pearson / Spearman are 0 when either side is constant (SciPy would return NaN and warn).

``tests/tasks/test_metrics.py`` checks every function against hand-computed values (and the two
numpy ones against scikit-learn). scikit-learn and SciPy are imported by the first metric that
uses them (about 0.5-1.5 s on an idle core, several under load), not with this module: a run's
start, ``export``, ``predict`` and a classification evaluation do not need them.
"""
from __future__ import annotations

import numpy as np

__all__ = ["accuracy", "macro_f1", "binary_f1", "matthews_corrcoef", "pearson", "spearman", "mse"]


def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    """(1/N) Σ [ŷ_i = y_i]; 0 for no examples.

    Computed with numpy, not ``sklearn.metrics.accuracy_score`` (equal on every 1-D input,
    ``tests/tasks/test_metrics.py``): importing scikit-learn for a mean of matches cost an
    ``evaluate`` of a small image model ~0.7 s of its ~8 s on an idle core (RESULTS §9.8)."""
    pred, gold = np.asarray(pred).reshape(-1), np.asarray(gold).reshape(-1)
    if len(pred) != len(gold):
        raise ValueError(f"accuracy: {len(pred)} predictions for {len(gold)} labels")
    return float(np.mean(pred == gold)) if len(gold) else 0.0


def macro_f1(pred: np.ndarray, gold: np.ndarray) -> float:
    """Unweighted mean over the classes present in ``gold`` of F1_c = 2TP/(2TP+FP+FN).

    Equal to ``sklearn.metrics.f1_score(gold, pred, labels=<gold classes>, average="macro",
    zero_division=0)`` on every 1-D input (``tests/tasks/test_metrics.py`` checks it against
    scikit-learn); computed with numpy because it is, with :func:`accuracy`, what every
    classification evaluation reports, and importing scikit-learn for it cost each ``evaluate``
    and each run's first evaluation ~0.5 s (RESULTS §9.8). A class of ``gold`` has TP + FN ≥ 1,
    so no F1_c divides by zero."""
    pred, gold = np.asarray(pred).reshape(-1), np.asarray(gold).reshape(-1)
    if len(pred) != len(gold):
        raise ValueError(f"macro_f1: {len(pred)} predictions for {len(gold)} labels")
    if not len(gold):
        return 0.0
    f1 = []
    for c in np.unique(gold):
        p, g = pred == c, gold == c
        tp = np.sum(p & g)
        f1.append(2 * tp / (2 * tp + np.sum(p & ~g) + np.sum(~p & g)))
    return float(np.mean(f1))


def binary_f1(pred: np.ndarray, gold: np.ndarray, positive=1) -> float:
    """F1 of the positive class (GLUE MRPC/QQP; ``sklearn.metrics.f1_score(pos_label=...)``)."""
    from sklearn import metrics as skm

    pred, gold = np.asarray(pred), np.asarray(gold)
    if not len(gold):
        return 0.0
    return float(skm.f1_score(gold == positive, pred == positive, zero_division=0))


def matthews_corrcoef(pred: np.ndarray, gold: np.ndarray) -> float:
    """MCC = (TP·TN − FP·FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) (GLUE CoLA;
    ``sklearn.metrics.matthews_corrcoef``); 0 when undefined."""
    from sklearn import metrics as skm

    pred, gold = np.asarray(pred), np.asarray(gold)
    if not len(gold):
        return 0.0
    return float(skm.matthews_corrcoef(gold, pred))


def _constant(a: np.ndarray) -> bool:
    return a.size < 2 or bool(np.all(a == a.flat[0]))


def pearson(pred: np.ndarray, gold: np.ndarray) -> float:
    """Pearson r = cov(ŷ, y) / (σ_ŷ σ_y) (``scipy.stats.pearsonr``); 0 when either is constant."""
    from scipy import stats

    x, y = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    if _constant(x) or _constant(y):
        return 0.0
    return float(stats.pearsonr(x, y).statistic)


def spearman(pred: np.ndarray, gold: np.ndarray) -> float:
    """Spearman ρ = Pearson correlation of the average ranks (``scipy.stats.spearmanr``); 0 when
    either side is constant."""
    from scipy import stats

    x, y = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    if _constant(x) or _constant(y):
        return 0.0
    return float(stats.spearmanr(x, y).statistic)


def mse(pred: np.ndarray, gold: np.ndarray) -> float:
    """(1/N) Σ (ŷ_i − y_i)² (``sklearn.metrics.mean_squared_error``); 0 for no examples."""
    from sklearn import metrics as skm

    x, y = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    return float(skm.mean_squared_error(y, x)) if len(y) else 0.0
