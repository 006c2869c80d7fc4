"""The split's coverage (fedgalore.federated.heterogeneity.label_coverage): a label one site alone
holds, a label no site holds, and sites whose rows are all one label are said by ``fedgalore
partition`` and by ``fedgalore run`` before training — with the site and its count, except under
``privacy.client``, whose server says only how many."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from fedgalore.cli import main
from fedgalore.federated.heterogeneity import label_coverage
from fedgalore.job.partition_files import coverage_warnings
from fedgalore_testing.assets import news_rows, write


TRIAGE = """\
name: triage
task:
  name: text_classification
  options: {{model: {model}, data: {{train: {train}, test: {test}}}, text_column: body, label_column: topic, max_length: 16}}
method: {{name: fedavg_full, rank: 4}}
federation: {{clients_per_round: null, rounds: 1, partition: {{kind: natural, column: site}}}}
train: {{lr: 1.0e-3, batch_size: 4, local_steps: 1}}
output: {{dir: {out}, progress: plain}}
"""


def test_label_coverage_by_hand():
    h = np.array([[5, 0, 3, 0],    # site 0: labels 0 and 2
                  [4, 12, 0, 0],   # site 1: label 1 alone is here (12 rows)
                  [0, 0, 7, 0]])   # site 2: all label 2; label 3: no site
    cov = label_coverage(h)
    assert cov.single == ((1, 1, 12),) and cov.absent == (3,) and cov.one_class == ((2, 2),)
    assert not label_coverage(np.array([[3, 2], [1, 4]]))  # every label at two sites, no site of one label
    assert not label_coverage(np.array([[3], [4]]))  # one category in all (a task without labels): nothing to say


def test_warnings_name_the_site_and_count_except_under_client_privacy():
    h = np.array([[5, 0, 3, 0], [4, 12, 0, 0], [0, 0, 7, 0]])
    labels, sites = ["cardio", "oncology", "ortho", "neuro"], ["clinic_a", "clinic_b", "clinic_c"]
    full = coverage_warnings(h, labels, sites)
    assert full[0] == ("1 label(s) held by one site only: label 'oncology' only at site 'clinic_b' (12 training rows); "
                       "such a label is learned only in the rounds that sample its site")
    assert full[1] == "1 label(s) with no training rows at any site: 'neuro'; the model never trains on them"
    assert full[2] == "1 of 3 sites hold one label only: 'clinic_c' (all 'ortho')"
    private = coverage_warnings(h, labels, sites, detail=False)
    assert len(private) == 3 and "privacy.client" in private[0] and "privacy.client" in private[2]
    text = " ".join(private)
    assert not any(s in text for s in sites) and "12" not in text and "oncology" not in text


@pytest.fixture
def triage(tmp_path, bert_dir):
    """News rows over sites s0..s3 with twelve 'oncology' rows, all at s2."""
    df = news_rows(64)
    onc = pd.DataFrame({"body": ["tumor chemo scan biopsy"] * 12, "topic": ["oncology"] * 12, "site": ["s2"] * 12})
    train = write(pd.concat([df.iloc[:48], onc], ignore_index=True), tmp_path / "train.csv")
    test = write(df.iloc[48:].reset_index(drop=True), tmp_path / "test.csv")
    path = tmp_path / "triage.yaml"
    path.write_text(TRIAGE.format(model=bert_dir, train=train, test=test, out=tmp_path / "runs"))
    return path


def test_partition_and_run_warn_before_training(triage, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    line = "label 'oncology' only at site 's2' (12 training rows)"
    assert main(["partition", "--config", str(triage), "--no-features", "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert f"warning: 1 label(s) held by one site only: {line}" in out
    assert json.loads((tmp_path / "p" / "partition.json").read_text())["warnings"][0].startswith("1 label(s) held by one")
    assert main(["run", "--config", str(triage)]) == 0
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert line in text and text.index(line) < text.index("round 1")  # said before the first round


def test_partition_under_client_privacy_says_how_many_not_where(triage, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))
    assert main(["partition", "--config", str(triage), "--no-features", "--out", str(tmp_path / "p"),
                 "privacy.client={noise_multiplier: 1.0}"]) == 0
    warned = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning:")]
    assert warned and warned[0].startswith("warning: 1 label(s) held by one site only;")
    assert not any("s2" in x or "12 training rows" in x or "oncology" in x for x in warned)
