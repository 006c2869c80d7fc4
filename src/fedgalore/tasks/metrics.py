"""Evaluation metrics (GLUE conventions): accuracy, macro-F1, binary F1, Matthews correlation,
Pearson / Spearman correlation and mean squared error. Plain numpy, checked in tests against
hand-computed values."""
from __future__ import annotations

import numpy as np

__all__ = ["accuracy", "macro_f1", "binary_f1", "matthews_corrcoef", "pearson", "spearman", "mse"]


def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    """(1/N) Σ [ŷ_i = y_i]."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    return float((pred == gold).mean()) if len(gold) else 0.0


def _f1(pred: np.ndarray, gold: np.ndarray, cls) -> float:
    tp = np.sum((pred == cls) & (gold == cls))
    fp = np.sum((pred == cls) & (gold != cls))
    fn = np.sum((pred != cls) & (gold == cls))
    return float(2 * tp / (2 * tp + fp + fn)) if (2 * tp + fp + fn) else 0.0


def macro_f1(pred: np.ndarray, gold: np.ndarray) -> float:
    """Unweighted mean over the classes present in ``gold`` of F1_c = 2TP/(2TP+FP+FN)."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    classes = np.unique(gold)
    return float(np.mean([_f1(pred, gold, c) for c in classes])) if len(classes) else 0.0


def binary_f1(pred: np.ndarray, gold: np.ndarray, positive=1) -> float:
    """F1 of the positive class (GLUE MRPC/QQP)."""
    return _f1(np.asarray(pred), np.asarray(gold), positive)


def matthews_corrcoef(pred: np.ndarray, gold: np.ndarray) -> float:
    """MCC = (TP·TN − FP·FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) for binary labels (GLUE CoLA); 0 when undefined."""
    pred, gold = np.asarray(pred).astype(bool), np.asarray(gold).astype(bool)
    tp = float(np.sum(pred & gold)); tn = float(np.sum(~pred & ~gold))
    fp = float(np.sum(pred & ~gold)); fn = float(np.sum(~pred & gold))
    den = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return float((tp * tn - fp * fn) / den) if den > 0 else 0.0


def pearson(pred: np.ndarray, gold: np.ndarray) -> float:
    """Pearson r = cov(ŷ, y) / (σ_ŷ σ_y); 0 when either is constant."""
    x, y = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    den = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / den) if den > 0 else 0.0


def _rank(a: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean rank), 1-based."""
    a = np.asarray(a, dtype=np.float64)
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(len(a), dtype=np.float64)
    sorted_a = a[order]
    i = 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and sorted_a[j + 1] == sorted_a[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(pred: np.ndarray, gold: np.ndarray) -> float:
    """Spearman ρ = Pearson correlation of the average ranks."""
    return pearson(_rank(pred), _rank(gold))


def mse(pred: np.ndarray, gold: np.ndarray) -> float:
    """(1/N) Σ (ŷ_i − y_i)²."""
    x, y = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    return float(np.mean((x - y) ** 2)) if len(y) else 0.0
