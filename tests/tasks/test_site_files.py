"""Per-site data files (issue 32): ``task.options.data: {sites: {NAME: DATA}}`` and
``federation.partition.kind: files`` — a federation whose members each hold their own files,
rehearsed on one machine.

What must hold: each site's rows are exactly the rows the site would have read alone (its own
test split drawn from its own file, its own ``limit``), in file order, so a deployment where every
site reads only its own files sees the same examples; client ``j`` of a ``files`` partition is the
``j``-th site in sorted order; each site is evaluated on its own test rows and the example-weighted
mean of the sites' accuracies is the pooled test accuracy; every mistake in a site's file is one
line naming that site's file and row. Tiny random BERT of conftest.py, data written here.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import fedgalore
from fedgalore.cli import main
from fedgalore.job.config import load_config
from fedgalore.jsonl import read_jsonl
from fedgalore.tasks import get_task
from fedgalore_testing.assets import TOPICS, news_rows, news_site_files, write


SITES = ["s1", "s0", "s2"]  # given out of sorted order on purpose


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDGALORE_CACHE", str(tmp_path / "cache"))


def site_files(root: Path, n: int = 90, fmt: str = ".csv") -> dict:
    """Per-site files of ``news_rows`` (no site column): s0 and s1 with a test file, s2 one file."""
    return news_site_files(root, SITES, n, fmt)


def task_of(bert_dir, data, **kw):
    return get_task("text_classification", model=str(bert_dir), data=data, text_column="body", label_column="topic",
                    max_length=16, **kw)


def texts(task, split: str) -> list[str]:
    return list(task._rows[split].column("body", "text_column"))


def test_each_site_reads_what_it_would_read_alone(tmp_path, bert_dir):
    data = site_files(tmp_path)
    both = task_of(bert_dir, {"sites": data}, limit=20, test_fraction=0.25)
    assert both.sites == SITES
    for split in ("train", "test"):
        sites = both.partition_values("site", split=split)
        assert list(dict.fromkeys(sites.tolist())) == SITES  # concatenated in the order given
        for s in SITES:
            alone = task_of(bert_dir, data[s], limit=20, test_fraction=0.25)  # the site's own files, no sites
            mine = np.flatnonzero(sites == s)
            assert [texts(both, split)[i] for i in mine] == texts(alone, split), (split, s)
            one = task_of(bert_dir, {"sites": {s: data[s]}}, limit=20, test_fraction=0.25)  # a node's view
            assert texts(one, split) == texts(alone, split)
    # s2 had no test file: its test rows were drawn from its own rows (25 %, stratified), not from the pool
    test = both._rows["test"]
    s2_rows = [test.row(i) for i in np.flatnonzero(both.partition_values("site", split="test") == "s2")]
    assert s2_rows and all(r.endswith(" of site 's2' s2_all.csv (held out)") for r in s2_rows), s2_rows
    assert both.describe()["sites"] == {"s1": 17, "s0": 17, "s2": 16}


def test_labels_option_fixes_the_classes_and_their_order(tmp_path, bert_dir):
    data = site_files(tmp_path)
    order = ["tech", "politics", "sport"]
    t = task_of(bert_dir, {"sites": data}, labels=order)
    assert t.label_names() == order
    y = t.train_set()[0]["labels"].item()
    assert order[y] == texts_label(t, 0)
    only_two = task_of(bert_dir, {"sites": {"s0": data["s0"]}}, labels=order)  # a site may lack classes, ids stay
    assert only_two.label_names() == order
    with pytest.raises(Exception, match=r"label 'sport' of .*row \d+ of site 's\d' s\d_\w+\.csv.* is not one of task\.options\.labels \(tech, politics\)"):
        task_of(bert_dir, {"sites": data}, labels=["tech", "politics"])


def texts_label(task, i: int) -> str:
    return task._rows["train"].column("topic", "label_column")[i]


CONFIG = """\
name: sites
task:
  name: text_classification
  options: {{model: {model}, text_column: body, label_column: topic, max_length: 16, data: {{sites: {sites}}}}}
method: {{name: fedgalore, rank: 4}}
federation: {{clients_per_round: null, rounds: 2, partition: {{kind: files}}}}
train: {{lr: 1.0e-3, batch_size: 4, local_steps: 2}}
output: {{dir: runs, progress: quiet}}
"""


def test_files_partition_trains_one_client_per_site_and_evaluates_each_on_its_own_test_rows(tmp_path, bert_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = site_files(tmp_path)
    (tmp_path / "run.yaml").write_text(CONFIG.format(model=bert_dir, sites=json.dumps(data)))
    res = fedgalore.run(load_config(tmp_path / "run.yaml"))
    run = Path(res.run_dir)
    part = json.loads((run / "partition.json").read_text())
    assert [c["name"] for c in part["clients"]] == sorted(SITES) and part["kind"] == "files"
    task = task_of(bert_dir, {"sites": data})
    train_sites = task.partition_values("site")
    assert part["sizes"] == [int(np.sum(train_sites == s)) for s in sorted(SITES)]  # every training row, by site
    rec = [r for r in read_jsonl(run / "metrics.jsonl") if "client_eval" in r][-1]
    per = rec["client_eval"]["clients"]
    test_sites = task.partition_values("site", split="test")
    assert {s: per[s]["n"] for s in per} == {s: int(np.sum(test_sites == s)) for s in SITES}
    n = np.array([per[s]["n"] for s in per])
    acc = np.array([per[s]["accuracy"] for s in per])
    assert rec["eval/client_mean_accuracy"] == pytest.approx(float(n @ acc / n.sum()), abs=1e-12)
    assert rec["eval/client_mean_accuracy"] == pytest.approx(rec["eval/accuracy"], abs=1e-9)  # the pooled test set
    names = {r.get("client_name") for r in read_jsonl(run / "clients.jsonl")}
    assert names == set(SITES)
    assert load_config(run / "config.yaml").federation.num_clients == 3


def _one_line(capsys, argv) -> str:
    rc = main(argv)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip() and not x.startswith("fedgalore: note")]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("fedgalore: error: "), lines
    return lines[0]


def test_mistakes_are_one_line_naming_the_site_file(tmp_path, bert_dir, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = site_files(tmp_path)
    cfg = tmp_path / "run.yaml"

    def error(sites, *over) -> str:
        cfg.write_text(CONFIG.format(model=bert_dir, sites=json.dumps(sites)))
        return _one_line(capsys, ["partition", "--config", str(cfg), *over])

    df = news_rows(30)
    write(df.drop(columns=["site"]).assign(body=lambda d: d.body.where(d.index != 4, "")), tmp_path / "bad.csv")
    assert "bad.csv: a row has an empty or NaN text in column 'body' (first: row 5)" in error({**data, "s2": str(tmp_path / "bad.csv")})
    write(df, tmp_path / "with_site.csv")  # already has a `site` column
    assert "with_site.csv (site 's2') has a column 'site'" in error({**data, "s2": str(tmp_path / "with_site.csv")})
    plain = {"train": data["s0"]["train"], "test": data["s0"]["test"]}
    cfg.write_text(CONFIG.format(model=bert_dir, sites="{}").replace("data: {sites: {}}", f"data: {json.dumps(plain)}"))
    assert "federation.partition.kind=files needs per-site data" in _one_line(capsys, ["partition", "--config", str(cfg)])
    valid = dict(data, s0={**data["s0"], "validation": data["s0"]["test"]})
    assert "sites s0 have a validation split and the others none" in error(valid)


def test_participation_and_batch_mistakes_name_the_sites(tmp_path, bert_dir, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(model=bert_dir, sites=json.dumps(site_files(tmp_path))))
    line = _one_line(capsys, ["partition", "--config", str(cfg), "federation.clients_per_round=5"])
    assert "clients_per_round=5 exceeds the 3 clients of the files partition (one client per site)" in line
    big = 64  # larger than every site's training rows
    line = _one_line(capsys, ["partition", "--config", str(cfg), f"train.batch_size={big}"])
    assert "The files partition (one client per site): client(s) 's0' (" in line and f"train.batch_size={big}" in line
    assert "merge or drop those sites in the data" in line


def test_evaluate_on_one_sites_test_file_gives_that_sites_metrics(tmp_path, bert_dir, monkeypatch, capsys):
    """``fedgalore evaluate --data FILE`` on a per-site run or its export: the test file alone with
    the run's classes; on a site's own test file it gives that site's last client_eval metrics."""
    from fedgalore.trained.evaluate import evaluate
    from fedgalore.trained.export import export_run

    monkeypatch.chdir(tmp_path)
    data = site_files(tmp_path)
    (tmp_path / "run.yaml").write_text(CONFIG.format(model=bert_dir, sites=json.dumps(data)))
    run = Path(fedgalore.run(load_config(tmp_path / "run.yaml")).run_dir)
    site = [r for r in read_jsonl(run / "metrics.jsonl") if "client_eval" in r][-1]["client_eval"]["clients"]["s0"]
    out = export_run(run, tmp_path / "exported")
    assert json.loads((tmp_path / "exported" / "fedgalore_export.json").read_text())["labels"] == sorted(TOPICS)
    for where in (run, out.out):
        ev = evaluate(where, data=data["s0"]["test"])
        assert ev.examples == site["n"] == 6
        assert ev.metrics["accuracy"] == pytest.approx(site["accuracy"], abs=1e-9)
        assert ev.metrics["loss"] == pytest.approx(site["loss"], abs=1e-5)
    assert main(["evaluate", str(tmp_path / "exported"), "--data", data["s1"]["test"]]) == 0
    assert "on text_classification (6 test examples): accuracy=" in capsys.readouterr().out


def test_site_count_mistakes_say_sites(tmp_path, bert_dir, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = site_files(tmp_path)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(model=bert_dir, sites=json.dumps(data)))
    line = _one_line(capsys, ["partition", "--config", str(cfg), "federation.num_clients=4"])
    assert "federation.num_clients=4, but task.options.data.sites names 3 sites (s0, s1, s2): kind files has one client per site" in line
    cfg.write_text(CONFIG.format(model=bert_dir, sites=json.dumps({"s0": data["s0"]})))
    line = _one_line(capsys, ["partition", "--config", str(cfg)])
    assert "task.options.data.sites names one site with training rows ('s0'); a federation needs at least 2" in line


def test_an_export_under_client_dp_carries_no_sites_files_or_sizes(tmp_path, bert_dir, monkeypatch, capsys):
    """Under client-level DP the export's fedgalore_identity.json drops the sites' inputs (their byte
    sizes and fingerprints would say how much each site holds), as its card does, and says so;
    the model's own entry stays. Without DP the export carries the run's identity.json whole
    (tests/trained/test_own_data.py)."""
    from fedgalore.cli import main

    monkeypatch.chdir(tmp_path)
    data = site_files(tmp_path)
    text = CONFIG.format(model=bert_dir, sites=json.dumps(data)).replace(
        "output:", "privacy: {client: {clip: 0.5, noise_multiplier: 1.0}}\noutput:").replace("rounds: 2", "rounds: 1").replace(
        "{name: fedgalore, rank: 4}", "{name: fedgalore, rank: 4, options: {projector: random, view_basis: seeded}}").replace(
        "local_steps: 2}", "local_steps: 2, weight_decay: 0.0}")
    (tmp_path / "run.yaml").write_text(text)
    run = Path(fedgalore.run(load_config(tmp_path / "run.yaml")).run_dir)
    recorded = json.loads((run / "identity.json").read_text())["inputs"]
    site_labels = [k for k in recorded if "sites" in k]
    assert site_labels and any("model" in k for k in recorded)  # the run itself recorded the sites' files
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    capsys.readouterr()
    exported = json.loads((tmp_path / "exported" / "fedgalore_identity.json").read_text())
    assert not any("sites" in k for k in exported["inputs"]) and any("model" in k for k in exported["inputs"])
    assert exported["withheld"].startswith(f"{len(site_labels)} data input(s) of the sites (client_central")
    everything = (tmp_path / "exported" / "fedgalore_identity.json").read_text() + (tmp_path / "exported" / "README.md").read_text()
    for label in site_labels:  # no site file's size or fingerprint (the config's own paths stay: the operator wrote them)
        assert recorded[label]["sha256"] not in everything and f'"size": {recorded[label]["size"]}' not in everything
        assert f"{recorded[label]['size']:,} B" not in everything
