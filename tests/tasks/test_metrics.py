"""Metric functions (fedgalore.tasks.metrics: scikit-learn / SciPy with the evaluation's conventions)
against hand-computed values — the checks the former hand-written implementations passed, kept as
equivalence checks — and the conventions at the edges (no examples, constant inputs)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fedgalore.tasks.metrics import accuracy, binary_f1, macro_f1, matthews_corrcoef, mse, pearson, spearman


def test_accuracy():
    assert accuracy([0, 1, 1, 2], [0, 1, 2, 2]) == pytest.approx(0.75)
    assert accuracy([], []) == 0.0


def test_accuracy_equals_sklearns_accuracy_score():
    """numpy's mean of matches is scikit-learn's accuracy_score on integer, string and numpy
    inputs (accuracy no longer imports scikit-learn); unequal lengths are refused."""
    from sklearn.metrics import accuracy_score

    rng = np.random.default_rng(0)
    for n, k in ((1, 2), (17, 3), (500, 10)):
        gold, pred = rng.integers(k, size=n), rng.integers(k, size=n)
        assert accuracy(pred, gold) == pytest.approx(accuracy_score(gold, pred), abs=1e-12)
        assert accuracy(list(pred), list(gold)) == pytest.approx(accuracy_score(gold, pred), abs=1e-12)
        names = np.array(["a", "bb", "c"] * 200)[:k]
        gs, ps = names[gold % len(names)], names[pred % len(names)]
        assert accuracy(ps, gs) == pytest.approx(accuracy_score(gs, ps), abs=1e-12)
    with pytest.raises(ValueError, match="3 predictions for 2 labels"):
        accuracy([1, 2, 3], [1, 2])


def test_macro_f1_equals_sklearns_f1_score_over_the_gold_classes():
    """macro_f1 (numpy) is f1_score(labels=<gold classes>, average="macro", zero_division=0): classes
    predicted but absent from gold do not count, a gold class never predicted counts 0."""
    from sklearn.metrics import f1_score

    rng = np.random.default_rng(1)
    for n, k, kp in ((1, 2, 2), (9, 3, 5), (40, 4, 6), (700, 10, 12)):
        gold, pred = rng.integers(k, size=n), rng.integers(kp, size=n)
        want = f1_score(gold, pred, labels=np.unique(gold), average="macro", zero_division=0)
        assert macro_f1(pred, gold) == pytest.approx(want, abs=1e-12)
        names = np.array([f"c{i}" for i in range(kp)])
        assert macro_f1(names[pred], names[gold]) == pytest.approx(want, abs=1e-12)
    with pytest.raises(ValueError, match="1 predictions for 2 labels"):
        macro_f1([1], [1, 2])


def test_macro_f1_hand_computed():
    # class 0: TP1 FP0 FN0 -> 1; class 1: TP1 FP1 FN0 -> 2/3; class 2: TP1 FP0 FN1 -> 2/3
    assert macro_f1([0, 1, 1, 2], [0, 1, 2, 2]) == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)
    # classes predicted but absent from gold do not enter the mean (class 3 here)
    assert macro_f1([0, 3], [0, 0]) == pytest.approx(2 * 1 / (2 * 1 + 0 + 1))


def test_binary_f1_hand_computed():
    pred, gold = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]  # TP2 FP1 FN1
    assert binary_f1(pred, gold) == pytest.approx(4 / 6)
    # positive = 0: TP1 (idx 2) FP1 (idx 3) FN1 (idx 1)
    assert binary_f1(pred, gold, positive=0) == pytest.approx(2 / 4)
    assert binary_f1([0, 0], [0, 0]) == 0.0  # no positive anywhere: defined as 0


def test_mcc_hand_computed():
    pred, gold = [1, 1, 0, 0, 1], [1, 0, 0, 1, 1]  # TP2 TN1 FP1 FN1
    assert matthews_corrcoef(pred, gold) == pytest.approx((2 * 1 - 1 * 1) / math.sqrt(3 * 3 * 2 * 2))
    assert matthews_corrcoef([1, 0, 1, 0], [1, 0, 1, 0]) == pytest.approx(1.0)
    assert matthews_corrcoef([1, 0, 1, 0], [0, 1, 0, 1]) == pytest.approx(-1.0)
    assert matthews_corrcoef([1, 1, 1], [1, 0, 1]) == 0.0  # undefined (constant prediction)


def test_pearson_hand_computed():
    # dx = (-1.5,-.5,.5,1.5), dy = (-3,-1,0,4): Σdxdy = 11, Σdx² = 5, Σdy² = 26
    assert pearson([1, 2, 3, 4], [2, 4, 5, 9]) == pytest.approx(11 / math.sqrt(130))
    assert pearson([1, 1, 1], [1, 2, 3]) == 0.0


def test_spearman_with_ties():
    # ranks x = (1, 2.5, 2.5, 4), y = (1, 3, 2, 4): Σdxdy = 4.5, Σdx² = 4.5, Σdy² = 5
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert spearman([10, 20, 30], [3, 2, 1]) == pytest.approx(-1.0)


def test_mse_hand_computed():
    assert mse([1, 2, 3], [1, 1, 5]) == pytest.approx(5 / 3)
    assert mse([0.5], [0.5]) == 0.0


def test_against_reference_implementations():
    sklearn = pytest.importorskip("sklearn.metrics")
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 4, 200), rng.integers(0, 4, 200)
    assert macro_f1(p, y) == pytest.approx(sklearn.f1_score(y, p, average="macro"))
    yb, pb = (y > 1).astype(int), (p > 1).astype(int)
    assert binary_f1(pb, yb) == pytest.approx(sklearn.f1_score(yb, pb))
    assert matthews_corrcoef(pb, yb) == pytest.approx(sklearn.matthews_corrcoef(yb, pb))
    a, b = rng.integers(0, 6, 300).astype(float), rng.normal(size=300)  # many ties in a
    assert spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic)
    assert pearson(a, b) == pytest.approx(stats.pearsonr(a, b).statistic)


def test_edge_conventions_without_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SciPy/sklearn would warn on constant input or no positives
        assert accuracy([], []) == macro_f1([], []) == binary_f1([], []) == matthews_corrcoef([], []) == mse([], []) == 0.0
        assert pearson([2, 2, 2], [1, 2, 3]) == spearman([1, 2, 3], [5, 5, 5]) == 0.0
        assert pearson([1.0], [2.0]) == 0.0
        assert binary_f1([0, 0, 0], [0, 0, 0]) == 0.0
        assert macro_f1([1, 1], [0, 1]) == pytest.approx((0.0 + 2 / 3) / 2)  # class 0 never predicted: F1 0
