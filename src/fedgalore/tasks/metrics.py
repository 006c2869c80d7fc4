"""Evaluation metrics (GLUE conventions): accuracy, macro-F1, binary F1, Matthews correlation,
Pearson / Spearman correlation and mean squared error.

Thin wrappers around the reference implementations users trust — scikit-learn
(``accuracy_score``, ``f1_score``, ``matthews_corrcoef``, ``mean_squared_error``) and SciPy
(``pearsonr``, ``spearmanr``) — fixing the conventions the federated evaluation needs:

* empty inputs give 0.0 (an evaluation on no examples reports nothing, never NaN);
* macro-F1 averages over the classes present in the gold labels (a class the model predicts
  but the test set lacks does not dilute the mean), with F1 = 0 for a class never predicted;
* binary F1 of a positive class absent from both predictions and gold is 0;
* Matthews correlation is 0 when undefined (constant predictions), as scikit-learn returns;
* Pearson / Spearman are 0 when either side is constant (SciPy would return NaN and warn).

``tests/tasks/test_metrics.py`` checks every function against hand-computed values. scikit-learn
and SciPy are imported by the first metric computed (about 1.5 s on an idle core, several under
load), not with this module: a run's start, ``export`` and ``predict`` do not need them.
"""
from __future__ import annotations

import numpy as np

__all__ = ["accuracy", "macro_f1", "binary_f1", "matthews_corrcoef", "pearson", "spearman", "mse"]


def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    """(1/N) Σ [ŷ_i = y_i] (``sklearn.metrics.accuracy_score``); 0 for no examples."""
    from sklearn import metrics as skm

    pred, gold = np.asarray(pred), np.asarray(gold)
    return float(skm.accuracy_score(gold, pred)) if len(gold) else 0.0


def macro_f1(pred: np.ndarray, gold: np.ndarray) -> float:
    """Unweighted mean over the classes present in ``gold`` of F1_c = 2TP/(2TP+FP+FN)
    (``sklearn.metrics.f1_score(average="macro", labels=<gold classes>)``)."""
    from sklearn import metrics as skm

    pred, gold = np.asarray(pred), np.asarray(gold)
    if not len(gold):
        return 0.0
    return float(skm.f1_score(gold, pred, labels=np.unique(gold), average="macro", zero_division=0))


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
