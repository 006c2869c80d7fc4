"""How non-IID a split is (fedgalore.federated.heterogeneity): label TV against the pool and its IID
floor, the bias-corrected feature shift, and ``fedgalore partition``'s record, table and figure."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from fedgalore.cli import main
from fedgalore.federated.partitioners.iid import iid_partition
from fedgalore.job.config import FederatedConfig
from fedgalore.federated.heterogeneity import feature_shift, label_tv, label_tv_iid, site_sample, weighted_mean
from fedgalore.tasks.synthetic import TinyTextTask
from fedgalore_testing.cmdline import _error


def _hist(labels: np.ndarray, parts, k: int) -> np.ndarray:
    return np.array([np.bincount(labels[p], minlength=k) for p in parts])


# ----------------------------------------------------------------------------- label side
def test_label_tv_by_hand():
    h = np.array([[3, 1, 0],   # p = (.75, .25, 0)
                  [1, 3, 0],   # p = (.25, .75, 0)
                  [0, 0, 4],   # p = (0, 0, 1)
                  [0, 0, 0]])  # no examples
    # pool: (4, 4, 4) / 12 = (1/3, 1/3, 1/3)
    tv = label_tv(h)
    assert tv[:3] == pytest.approx([0.5 * (5 / 12 + 1 / 12 + 1 / 3), 0.5 * (1 / 12 + 5 / 12 + 1 / 3), 2 / 3], abs=1e-12)
    assert np.isnan(tv[3])
    assert weighted_mean(tv, h.sum(1)) == pytest.approx((4 * 5 / 12 + 4 * 5 / 12 + 4 * 2 / 3) / 12, abs=1e-12)
    assert label_tv(np.array([[2, 2], [5, 5]])) == pytest.approx([0, 0], abs=1e-12)  # the pool's mix: 0
    assert label_tv(np.array([[3, 0], [0, 7]])) == pytest.approx([0.7, 0.3], abs=1e-12)  # disjoint clients


def test_label_tv_iid_is_what_an_iid_split_reads():
    rng = np.random.default_rng(0)
    k = 4
    labels = rng.choice(k, size=2400, p=[0.4, 0.3, 0.2, 0.1])
    realised, floor = [], []
    for seed in range(8):
        h = _hist(labels, iid_partition(len(labels), 12, seed), k)
        realised.append(weighted_mean(label_tv(h), h.sum(1)))
        floor.append(label_tv_iid(h, seed))
    assert np.mean(floor) == pytest.approx(np.mean(realised), rel=0.12)
    assert label_tv_iid(h, 3) == label_tv_iid(h, 3)  # seeded

    # unequal sizes (and more clients than categories, and the reverse): a brute-force random split agrees
    for sizes, kk in (([50, 300, 120, 30, 500], 6), ([400, 200], 9)):
        y = rng.integers(0, kk, size=sum(sizes))
        cuts = np.cumsum(sizes)[:-1]
        brute = []
        for _ in range(400):
            table = np.array([np.bincount(c, minlength=kk) for c in np.split(rng.permutation(y), cuts)])
            brute.append(weighted_mean(label_tv(table), sizes))
        h = np.array([np.bincount(c, minlength=kk) for c in np.split(y, cuts)])
        assert label_tv_iid(h, 0, repeats=200) == pytest.approx(np.mean(brute), rel=0.05)

    # a skewed split reads far above its floor
    from fedgalore.federated.partitioners.dirichlet import dirichlet_partition

    h = _hist(labels, dirichlet_partition(labels, 12, 0.1, seed=0), k)
    assert weighted_mean(label_tv(h), h.sum(1)) > 4 * label_tv_iid(h, 0)


# ----------------------------------------------------------------------------- feature side
def _gaussian_sites(sizes, d=24, shifted=0, delta=3.0, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(sum(sizes), d))
    sites = np.repeat(np.arange(len(sizes)), sizes)
    shift = np.zeros(d)
    shift[:2] = delta / np.sqrt(2)
    x[sites == shifted] += shift
    return x, sites, shift


def _expected_shift(sizes, shift, d, site):
    """The population value: ‖m_i − m̄‖ / √(tr Σ_pool), one site moved by ``shift``, unit within-site covariance."""
    w = np.asarray(sizes, float) / sum(sizes)
    means = np.zeros((len(sizes), d))
    means[0] = shift
    pool = w @ means
    tr = d + w @ np.sum((means - pool) ** 2, axis=1)
    return float(np.linalg.norm(means[site] - pool) / np.sqrt(tr))


def test_feature_shift_recovers_a_known_shift():
    d, sizes = 24, [100, 2500, 1800, 3000, 600]
    x, sites, delta = _gaussian_sites(sizes, d=d)
    got = feature_shift(x, sites)
    # the moved site: ‖δ‖/√(tr Σ) up to its own share of the pool; the others: near 0
    assert got[0] == pytest.approx(_expected_shift(sizes, delta, d, 0), rel=0.08)
    assert got[0] == pytest.approx(np.linalg.norm(delta) / np.sqrt(d), rel=0.08)
    assert np.all(got[1:] < 0.05)

    # capped sampling (min(64, n_i) per site) weighted back to the pool: the same numbers
    parts = [np.flatnonzero(sites == j) for j in range(len(sizes))]
    idx = np.concatenate(site_sample(parts, 64, seed=0))
    capped = feature_shift(x[idx], sites[idx], sizes=sizes)
    assert capped[0] == pytest.approx(_expected_shift(sizes, delta, d, 0), rel=0.15)
    assert np.all(capped[1:] < 0.12)


@pytest.mark.parametrize("cap", [None, 64])
def test_feature_shift_of_an_iid_split_is_near_zero(cap):
    sizes = [40, 900, 150, 2000, 75, 400]  # unequal on purpose: the (1/n_i - 1/N) term removes the floor
    x, sites, _ = _gaussian_sites(sizes, delta=0.0, seed=1)
    if cap is None:
        got = feature_shift(x, sites)
    else:
        parts = [np.flatnonzero(sites == j) for j in range(len(sizes))]
        idx = np.concatenate(site_sample(parts, cap, seed=0))
        got = feature_shift(x[idx], sites[idx], sizes=sizes)
    assert np.all(got < 0.1) and weighted_mean(got, sizes) < 0.05
    # without the correction, the raw standardised distance of a small site is far from 0
    raw = np.linalg.norm(x[sites == 0].mean(0) - x.mean(0)) / np.sqrt(np.trace(np.cov(x.T)))
    assert raw > 0.1


def test_feature_shift_formula_as_written():
    """sizes=None (or sizes = the sampled counts) is the docstring's formula, term by term."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(90, 5)) + np.repeat(rng.normal(size=(3, 5)), [20, 30, 40], axis=0)
    sites = np.repeat([0, 1, 2], [20, 30, 40])
    mu, tr = x.mean(0), np.trace(np.cov(x.T))
    by_hand = [np.sqrt(max(0.0, np.sum((x[sites == i].mean(0) - mu) ** 2) / tr - (1 / n - 1 / 90)))
               for i, n in enumerate([20, 30, 40])]
    assert feature_shift(x, sites) == pytest.approx(by_hand, abs=1e-9)
    assert feature_shift(x, sites, sizes=[20, 30, 40]) == pytest.approx(by_hand, abs=1e-9)
    assert feature_shift(x, sites, sizes=[200, 300, 400]) == pytest.approx(by_hand, abs=1e-9)  # proportional
    assert np.isnan(feature_shift(x, sites, num_sites=4)[3])  # a site without rows
    with pytest.raises(ValueError, match="one per row"):
        feature_shift(x, sites[:-1])


def test_site_sample_is_the_same_rule_for_every_client():
    parts = [np.arange(0, 10), np.arange(10, 200), np.arange(200, 264)]
    picks = site_sample(parts, 64, seed=3)
    assert [len(p) for p in picks] == [10, 64, 64]
    assert all(set(p) <= set(q) for p, q in zip(picks, parts))
    assert all(np.array_equal(a, b) for a, b in zip(picks, site_sample(parts, 64, seed=3)))
    assert not np.array_equal(picks[1], site_sample(parts, 64, seed=4)[1])
    # a client's sample does not depend on the other clients
    assert np.array_equal(site_sample([np.arange(5), parts[1]], 64, seed=3)[1], picks[1])


# ----------------------------------------------------------------------------- fedgalore partition
YAML = """\
name: het
seed: 0
task: {name: tiny_text, options: {n_train: 360, n_test: 16, hidden_size: 16, num_layers: 1, seq_len: 12}}
method: {name: fedavg_full, rank: 4}
federation: {num_clients: 6, clients_per_round: 2, rounds: 1, validation_fraction: 0.0,
             partition: {kind: dirichlet, alpha: 0.1, min_size: 4}}
train: {lr: 1.0e-3, batch_size: 4, local_steps: 1}
output: {dir: RUNS, progress: quiet}
"""

SUMMARY = re.compile(r"^heterogeneity: label TV (\d\.\d\d) \(IID split: (\d\.\d\d)\)(, feature shift (\d\.\d\d) \(IID ≈ 0\))?$", re.M)


@pytest.fixture
def het_yaml(tmp_path):
    path = tmp_path / "het.yaml"
    path.write_text(YAML.replace("RUNS", str(tmp_path / "runs")))
    return path


def test_partition_command_reports_heterogeneity(het_yaml, tmp_path, capsys):
    found = {}
    for setting in ("dirichlet", "iid"):
        out_dir = tmp_path / setting
        assert main(["partition", "--config", str(het_yaml), f"federation.partition.kind={setting}", "--out", str(out_dir)]) == 0
        printed = capsys.readouterr()
        rec = json.loads((out_dir / "partition.json").read_text())
        het = rec["heterogeneity"]
        assert f"feature shift: embedding {het['feature']['examples']} training examples" in printed.err
        assert "--no-features skips this" in printed.err
        assert len(het["label_tv"]) == len(het["feature_shift"]) == 6
        assert het["feature"]["examples_per_site"] == 64
        assert het["feature"]["examples"] == sum(min(64, n) for n in rec["sizes"])
        assert het["feature"]["representation"] == "last hidden state, mean-pooled"
        assert "BertForSequenceClassification" in het["feature"]["model"]
        assert het["label_tv_mean"] == pytest.approx(weighted_mean(het["label_tv"], rec["sizes"]), abs=1e-5)
        assert het["feature_shift_mean"] == pytest.approx(weighted_mean(het["feature_shift"], rec["sizes"]), abs=1e-5)
        assert het["label_tv"] == pytest.approx(label_tv(np.array(rec["histograms"])), abs=1e-5)
        (line,) = SUMMARY.findall(printed.out)
        assert float(line[0]) == pytest.approx(het["label_tv_mean"], abs=0.005)
        assert float(line[1]) == pytest.approx(het["label_tv_iid"], abs=0.005)
        assert float(line[3]) == pytest.approx(het["feature_shift_mean"], abs=0.005)
        header = printed.out.splitlines()[1].split()
        assert header[:4] == ["client", "train", "TV", "shift"]
        found[setting] = het
    # the skewed split stands far above its IID floor, on labels and on features; the IID split sits at it
    d, i = found["dirichlet"], found["iid"]
    assert d["label_tv_mean"] > 3 * d["label_tv_iid"]
    assert i["label_tv_mean"] == pytest.approx(i["label_tv_iid"], abs=0.06)
    assert d["feature_shift_mean"] > 0.2 and i["feature_shift_mean"] < 0.1

    # --no-features: the label side only, no model built; --feature-examples caps the sample
    assert main(["partition", "--config", str(het_yaml), "--no-features", "--out", str(tmp_path / "nf")]) == 0
    printed = capsys.readouterr()
    het = json.loads((tmp_path / "nf" / "partition.json").read_text())["heterogeneity"]
    assert set(het) == {"label_tv", "label_tv_mean", "label_tv_iid"} and het["label_tv"] == d["label_tv"]
    (line,) = SUMMARY.findall(printed.out)
    assert line[2] == "" and "embedding" not in printed.err and "shift" not in printed.out
    assert main(["partition", "--config", str(het_yaml), "--feature-examples", "8", "--out", str(tmp_path / "f8")]) == 0
    capsys.readouterr()
    rec = json.loads((tmp_path / "f8" / "partition.json").read_text())
    assert rec["heterogeneity"]["feature"]["examples_per_site"] == 8
    assert rec["heterogeneity"]["feature"]["examples"] == sum(min(8, n) for n in rec["sizes"]) < 48  # a client holds < 8


@pytest.mark.parametrize("value", ["0", "-3", "many", "1.5"])
def test_bad_feature_examples_is_one_line(het_yaml, capsys, value):
    line = _error(capsys, ["partition", "--config", str(het_yaml), "--feature-examples", value])
    assert "--feature-examples must be an integer >= 1" in line and repr(value) in line


class _NoHiddenStates(TinyTextTask):
    """tiny_text whose model answers with logits only (no ``output_hidden_states``)."""

    def build_model(self):
        import torch
        from torch import nn

        class Bag(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.EmbeddingBag(64, 4)

            def forward(self, input_ids, attention_mask=None):
                return torch.log_softmax(self.emb(input_ids), -1)

        return Bag()


def test_a_model_without_hidden_states_skips_the_feature_side(het_yaml, tmp_path):
    from fedgalore.job.config import load_config
    from fedgalore.job.partition_files import format_partition, preview_partition

    cfg = load_config(het_yaml, [])
    task = _NoHiddenStates(n_train=360, n_test=16, hidden_size=16, num_layers=1, seq_len=12)
    rec, d = preview_partition(cfg, tmp_path / "nohidden", task=task, feature_examples=16)
    het = rec["heterogeneity"]
    assert "feature_shift" not in het and het["feature"]["examples_per_site"] == 16
    assert "output_hidden_states" in het["feature"]["skipped"]
    text = format_partition(rec)
    (line,) = [x for x in text.splitlines() if x.startswith("heterogeneity:")]
    assert "; feature shift skipped: TypeError" in line and "\n" not in het["feature"]["skipped"]
    assert json.loads((d / "partition.json").read_text()) == rec
    assert (d / "partition.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_runs_record_the_label_side_and_the_figure_draws_it(tmp_path):
    """partition_record (what every run writes) has the label side only; the figure gains the
    heterogeneity panel, and a record written before it existed still draws."""
    from fedgalore.job.clients import resolve_clients, split_clients
    from fedgalore.job.partition_files import partition_figure, partition_record

    cfg = FederatedConfig.from_dict({
        "name": "het", "seed": 0, "task": {"name": "tiny_text", "options": {"n_train": 360, "n_test": 16}},
        "method": {"name": "fedavg_full", "rank": 4},
        "federation": {"num_clients": 6, "clients_per_round": 2, "rounds": 1,
                       "partition": {"kind": "dirichlet", "alpha": 0.1, "min_size": 4}},
        "train": {"lr": 1e-3, "batch_size": 4, "local_steps": 1}, "output": {"dir": str(tmp_path), "progress": "quiet"}})
    task = TinyTextTask(n_train=360, n_test=16)
    clients = split_clients(cfg, task)
    rec = partition_record(resolve_clients(cfg, clients), task, clients)
    assert set(rec["heterogeneity"]) == {"label_tv", "label_tv_mean", "label_tv_iid"}
    assert rec == partition_record(resolve_clients(cfg, clients), task, clients)  # seeded: the same record every time
    fig = partition_figure(rec)
    assert len(fig.axes) == 4  # sizes, heterogeneity, heat map, colour bar
    assert "label TV" in " ".join(t.get_text() for t in fig.axes[1].get_legend().get_texts())
    old = {k: v for k, v in rec.items() if k != "heterogeneity"}
    assert len(partition_figure(old).axes) == 3
