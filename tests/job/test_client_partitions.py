"""The run's clients (fedgalore.job.clients): partitions by a column (natural, partition.by), the
validation and per-client hold-outs, partition.json / partition.png, ``fedgalore partition``, per-client
evaluation (fedgalore.engine.client_eval) in metrics.jsonl and the report, and their bad inputs."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

import fedgalore
from fedgalore.cli import main
from fedgalore.job.clients import resolve_clients, split_clients
from fedgalore.job.config import ConfigError, FederatedConfig, config_difference
from fedgalore.federated.partition import PartitionError
from fedgalore.jsonl import read_jsonl
from fedgalore.tasks.base import TaskError
from fedgalore.tasks.synthetic import TinyTextTask

N_TRAIN = 160


class SiteTask(TinyTextTask):
    """tiny_text with extra columns per training example: ``site`` (north 50 %, south 30 %, east
    20 %), ``one`` (a single value), ``tiny`` (a site with 3 rows) and ``type`` (3 categories)."""

    name = "site_text"

    def partition_values(self, column=None):
        n = len(self.train_set())
        rng = np.random.default_rng(5)
        if column == "site":
            return np.array(["north"] * (n // 2) + ["south"] * (3 * n // 10) + ["east"] * (n - n // 2 - 3 * n // 10))[rng.permutation(n)]
        if column == "one":
            return np.array(["only"] * n)
        if column == "tiny":
            return np.array(["big"] * (n - 3) + ["small"] * 3)
        if column == "type":
            return np.array(["algebra", "counting", "geometry"])[rng.integers(0, 3, n)]
        return super().partition_values(column)


@pytest.fixture
def site_task_registered(monkeypatch):
    """``task.name: site_text`` for the CLI (a module the task registry can import)."""
    from fedgalore.tasks import TASKS

    mod = types.ModuleType("fg_site_tasks")
    mod.SiteTask = SiteTask
    monkeypatch.setitem(sys.modules, "fg_site_tasks", mod)
    monkeypatch.setitem(TASKS, "site_text", "fg_site_tasks:SiteTask")


def _cfg(tmp_path, **federation) -> FederatedConfig:
    fed = {"clients_per_round": None, "rounds": 2, "partition": {"kind": "natural", "column": "site"}, **federation}
    return FederatedConfig.from_dict({
        "name": "sites", "seed": 0,
        "task": {"name": "site_text", "options": {"n_train": N_TRAIN, "n_test": 32}},
        "method": {"name": "fedavg_full", "rank": 4},
        "federation": fed,
        "train": {"lr": 1e-2, "batch_size": 8, "local_epochs": 1},
        "output": {"dir": str(tmp_path / "runs"), "progress": "quiet"},
    })


def _task():
    return SiteTask(n_train=N_TRAIN, n_test=32)


YAML = """\
name: sites
task: {name: site_text, options: {n_train: 160, n_test: 32}}
method: {name: fedavg_full, rank: 4}
federation: {clients_per_round: null, rounds: 2, partition: {kind: natural, column: site}}
train: {lr: 1.0e-2, batch_size: 8, local_epochs: 1}
output: {dir: RUNS, progress: quiet}
"""


# ----------------------------------------------------------------------------- config
def test_natural_infers_num_clients(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.federation.num_clients is None  # left out: inferred (not the default 20)
    clients = split_clients(cfg, _task())
    resolved = resolve_clients(cfg, clients)
    assert resolved.federation.num_clients == 3 and cfg.federation.num_clients is None
    assert clients.names == ["east", "north", "south"]
    # the saved (resolved) config and the config as given are the same run
    assert config_difference(resolved.to_dict(), cfg.to_dict()) is None
    assert config_difference(resolved.to_dict(), _cfg(tmp_path, partition={"kind": "natural", "column": "tiny"}).to_dict())
    with pytest.raises(ConfigError, match="federation.num_clients=null needs federation.partition.kind=natural"):
        _cfg(tmp_path, num_clients=None, partition={"kind": "iid"})
    with pytest.raises(ConfigError, match=r"client_test_fraction=1.0 must be in \(0, 1\)"):
        _cfg(tmp_path, client_test_fraction=1.0)


@pytest.mark.parametrize("federation, match", [
    ({"num_clients": 5}, r"federation.num_clients=5, but column 'site' has 3 distinct values \(east, north, south\)"),
    ({"partition": {"kind": "natural", "column": "one"}}, r"column='one' has a single value \('only'\)"),
    ({"partition": {"kind": "natural", "column": "tiny"}},
     r"client\(s\) 'small' \(3\) hold fewer training examples than one batch \(train.batch_size=8\); set train.batch_size<=3"),
    ({"clients_per_round": 5}, r"clients_per_round=5 exceeds the 3 clients of the natural partition over 'site'"),
    ({"partition": {"kind": "natural", "column": "city"}}, "has no column 'city'"),
    ({"client_eval": True, "client_test_fraction": 0.01}, r"client_test_fraction=0.01 holds out no example of client 'east'"),
])
def test_bad_natural_inputs_are_one_line(tmp_path, federation, match):
    cfg = _cfg(tmp_path, **federation)
    with pytest.raises((ConfigError, PartitionError, TaskError), match=match) as err:
        resolve_clients(cfg, split_clients(cfg, _task()))
    assert "\n" not in str(err.value)


def test_cli_errors_of_natural_partitions(tmp_path, capsys, site_task_registered):
    path = tmp_path / "sites.yaml"
    path.write_text(YAML.replace("RUNS", str(tmp_path / "runs")))
    for over, expect in [("federation.num_clients=4", "but column 'site' has 3 distinct values"),
                         ("federation.partition.column=one", "has a single value ('only')"),
                         ("federation.partition.column=tiny", "client(s) 'small' (3) hold fewer training examples"),
                         ("federation.partition.kind=stratified", "kind must be one of iid, dirichlet, natural")]:
        assert main(["partition", "--config", str(path), over]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("fedgalore: error: ") and expect in err[0], err


# ----------------------------------------------------------------------------- the split
def test_every_example_in_exactly_one_place_with_validation_and_hold_out(tmp_path):
    cfg = _cfg(tmp_path, validation_fraction=0.1, client_eval=True, client_test_fraction=0.25)
    task = _task()
    clients = split_clients(cfg, task)
    sites = task.partition_values("site")
    every = np.concatenate([clients.validation_idx, *clients.parts, *clients.test_parts])
    np.testing.assert_array_equal(np.sort(every), np.arange(N_TRAIN))  # disjoint and covering
    labels = task.partition_labels()
    for name, train, test in zip(clients.names, clients.parts, clients.test_parts):
        assert set(sites[train]) == set(sites[test]) == {name}  # a client's examples are its site's
        n = len(train) + len(test)
        for c in np.unique(labels[np.concatenate([train, test])]):  # stratified: round(f · n_c) per class
            k = int(np.sum(labels[train] == c) + np.sum(labels[test] == c))
            assert np.sum(labels[test] == c) == round(0.25 * k)
        assert 0.15 * n < len(test) < 0.35 * n
    # a worker (Ray actor, Flower node) is given the training parts: nothing is held out again
    worker = split_clients(cfg, task, parts=clients.parts)
    assert worker.test_parts is None and _same(worker.parts, clients.parts)


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_partition_by_a_column_for_any_kind(tmp_path):
    task = _task()
    sites = task.partition_values("site")
    cfg = _cfg(tmp_path, num_clients=4, partition={"kind": "pathological", "classes_per_client": 1, "by": "site"},
               validation_fraction=0.2)
    clients = split_clients(cfg, task)
    assert [len(set(sites[p])) for p in clients.parts] == [1, 1, 1, 1]  # one site (the "class") per client
    np.testing.assert_array_equal(clients.categories, sites)
    val = sites[clients.validation_idx]  # the validation pool is stratified by the same column
    assert {s: int(np.sum(val == s)) for s in ("east", "north", "south")} == {"east": 6, "north": 16, "south": 10}
    from fedgalore.job.partition_files import partition_record

    rec = partition_record(cfg, task, clients)
    assert rec["by"] == "site" and rec["label_names"] == ["east", "north", "south"]
    assert rec["options"] == {"classes_per_client": 1, "class_assignment": "first-deterministic", "by": "site"}


# ----------------------------------------------------------------------------- a run, its files, its report
def test_natural_run_with_client_eval(tmp_path, capsys, site_task_registered):
    cfg = _cfg(tmp_path, client_eval=True, validation_fraction=0.1)
    res = fedgalore.run(cfg, task=_task())
    d = res.run_dir
    assert d.name == "sites-fedavg_full-naturalsite-s0"
    part = json.loads((d / "partition.json").read_text())
    assert (part["setting"], part["kind"], part["options"]) == ("natural:site", "natural", {"column": "site"})
    assert part["client_names"] == [c["name"] for c in part["clients"]] == ["east", "north", "south"]
    sizes, tests = np.array(part["sizes"]), np.array(part["test_sizes"])
    assert sizes.sum() + tests.sum() + part["validation_size"] == N_TRAIN
    hist = np.array(part["histograms"])
    np.testing.assert_array_equal(hist.sum(1), sizes)
    assert [sum(c["histogram"].values()) for c in part["clients"]] == part["sizes"]
    assert (d / "partition.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "num_clients: 3" in (d / "config.yaml").read_text()
    names = {r["client"]: r["client_name"] for r in read_jsonl(d / "clients.jsonl")}
    assert names == {0: "east", 1: "north", 2: "south"}

    history = read_jsonl(d / "metrics.jsonl")
    assert len(history) == 2
    for rec in history:
        per = rec["client_eval"]["clients"]
        assert list(per) == ["east", "north", "south"] and [per[c]["n"] for c in per] == part["test_sizes"]
        n = np.array([per[c]["n"] for c in per], dtype=float)
        for m in ("accuracy", "loss", "macro_f1"):
            v = np.array([per[c][m] for c in per])
            assert rec[f"eval/client_mean_{m}"] == pytest.approx(float(n @ v / n.sum()), rel=1e-12)
        acc = np.array([per[c]["accuracy"] for c in per])
        assert rec["eval/client_worst_accuracy"] == acc.min()
        assert rec["client_eval"]["worst_client"] == list(per)[int(np.argmin(acc))]
        assert rec["eval/client_std_accuracy"] == pytest.approx(acc.std(), abs=1e-12)
        assert rec["eval/client_range_accuracy"] == pytest.approx(acc.max() - acc.min(), abs=1e-12)
    assert res.summary["final"]["client_worst_accuracy"] == history[-1]["eval/client_worst_accuracy"]
    assert "client_eval" not in (d / "metrics.csv").read_text().splitlines()[0]

    # the preview draws the split the run trained on
    yaml = tmp_path / "sites.yaml"
    yaml.write_text(YAML.replace("RUNS", str(tmp_path / "runs"))
                    .replace("rounds: 2,", "rounds: 2, client_eval: true, validation_fraction: 0.1,"))
    assert main(["partition", "--config", str(yaml), "--out", str(tmp_path / "preview")]) == 0
    out = capsys.readouterr().out
    assert "partition natural:site: 3 clients" in out and "north" in out and "wrote" in out
    preview = json.loads((tmp_path / "preview" / "partition.json").read_text())
    assert "feature_shift" in preview["heterogeneity"]  # the preview also embeds examples; a run records the label side
    for key in ("feature_shift", "feature_shift_mean", "feature"):
        preview["heterogeneity"].pop(key)
    assert preview == part
    assert (tmp_path / "preview" / "partition.png").is_file()

    # the report: a per-client table (printed) and curves
    assert main(["report", str(d), "--out", str(tmp_path / "report"), "--no-plots"]) == 0
    out = capsys.readouterr().out
    table = (tmp_path / "report" / "client_eval.md").read_text()
    last = history[-1]
    assert f"| north | {last['client_eval']['clients']['north']['n']} | {last['client_eval']['clients']['north']['accuracy']:.4f} |" in table
    assert "**weighted mean**" in table and f"worst client: **{last['client_eval']['worst_client']}**" in out
    from fedgalore.report import load_run
    from fedgalore.report.plots import plot_client_eval

    assert [f.name for f in plot_client_eval([load_run(d)], tmp_path / "plots")] == ["client_eval.png", "client_eval.pdf"]


# ----------------------------------------------------------------------------- comparisons and plans
def test_compare_settings_of_the_new_kinds(tmp_path):
    from fedgalore.compare import plan_grid

    base = _cfg(tmp_path, num_clients=4, clients_per_round=2, partition={"kind": "dirichlet", "alpha": 0.5, "min_size": 3})
    cells = plan_grid(base, ["fedavg_full"], ["iid", "natural:site", "pathological:1@site", "quantity:power2"], [0], tmp_path)
    by = {c.setting: c.cfg for c in cells}
    assert list(by) == ["iid", "natural:site", "pathological:1@site", "quantity:power2"]
    assert by["natural:site"].federation.num_clients is None  # inferred from the data
    p = by["pathological:1@site"].federation.partition
    assert (p.kind, p.classes_per_client, p.by, p.min_size) == ("pathological", 1, "site", 3)  # the rest: the base's
    q = by["quantity:power2"].federation.partition
    assert (q.size_skew, q.power) == ("power", 2.0)
    assert [c.name for c in cells] == ["fedavg_full-iid-s0", "fedavg_full-naturalsite-s0",
                                       "fedavg_full-pathological1@site-s0", "fedavg_full-quantitypower2-s0"]


def test_plan_uses_the_runs_split(tmp_path):
    from fedgalore.plan import _client_sizes

    cfg = _cfg(tmp_path, validation_fraction=0.1)
    assert _client_sizes(cfg, _task(), None) == [len(p) for p in split_clients(cfg, _task()).parts]


# ----------------------------------------------------------------------------- docs/data.md, "Partitions"
def _data_md_blocks(lang: str) -> list[str]:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "data.md").read_text()
    section = text.split("## Partitions", 1)[1].split("\n## ", 1)[0]
    return [m.group(2) for m in re.finditer(r"```(\w*)\n(.*?)```", section, re.S) if m.group(1) == lang]


def test_data_md_python_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (code,) = _data_md_blocks("python")
    exec(compile(code, "docs/data.md", "exec"), {"__name__": "docs_data_md"})  # noqa: S102 - the docs' own example
    out = capsys.readouterr().out
    assert "partition natural:site: 3 clients" in out and "clinic-b" in out
    assert (tmp_path / "runs" / "partitions" / "sites-naturalsite-s0" / "partition.png").is_file()
    assert json.loads((tmp_path / "runs" / "sites-fedavg_full-naturalsite-s0" / "partition.json").read_text())[
        "client_names"] == ["clinic-a", "clinic-b", "clinic-c"]


def test_data_md_yaml_examples_are_valid_configs(tmp_path):
    from omegaconf import OmegaConf

    for block in _data_md_blocks("yaml"):
        fed = OmegaConf.to_container(OmegaConf.create(block))["federation"]
        cfg = _cfg(tmp_path, **fed)
        clients = split_clients(cfg, SiteTask(n_train=2000, n_test=16))  # each example's section splits the site task
        assert resolve_clients(cfg, clients).federation.num_clients == len(clients.parts)


@pytest.mark.slow
@pytest.mark.assets
def test_data_md_commands_run(tmp_path, monkeypatch, capsys):
    import shlex
    from pathlib import Path

    from fedgalore_testing import minilm_or_skip

    minilm_or_skip()
    (tmp_path / "conf").symlink_to(Path(__file__).resolve().parents[2] / "conf")
    monkeypatch.chdir(tmp_path)
    (bash,) = _data_md_blocks("bash")
    for cmd in bash.strip().splitlines():
        assert main(shlex.split(cmd)[1:]) == 0, cmd
        out = capsys.readouterr().out
        assert "20 clients, 1781 training examples" in out
    assert (tmp_path / "runs" / "split-pathological" / "partition.png").is_file()
